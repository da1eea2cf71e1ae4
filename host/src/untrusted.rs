//! Text that comes from plugins or rows (failure reasons, log messages, versions, init errors),
//! made safe to store, log and print: bounded in length, and with control characters escaped so
//! that a newline cannot forge a log line and an escape sequence cannot repaint a terminal; so are
//! the marks that reorder text on screen (bidirectional overrides), so that what a terminal shows
//! is what the text says.

/// Longest failure reason stored with an event.
pub const MAX_REASON: usize = 2048;

/// Longest plugin log message written to ferry's log.
pub const MAX_LOG_LINE: usize = 4096;

/// `text` with control characters escaped (`\n`, `\u{1b}`), cut to at most `max` bytes on a
/// character boundary; a cut says how long the text was.
pub fn clean(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max));
    for (at, c) in text.char_indices() {
        let piece: String = if hidden(c) { c.escape_default().collect() } else { c.to_string() };
        if out.len() + piece.len() > max {
            out.push_str(&format!("… ({} more bytes)", text.len() - at));
            return out;
        }
        out.push_str(&piece);
    }
    out
}

/// `text` for a terminal: control characters escaped except line breaks and tabs, so a stored
/// value cannot move the cursor or repaint the screen; not cut.
pub fn printable(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let escape = hidden(c) && c != '\n' && c != '\t';
            let piece: Vec<char> = if escape { c.escape_default().collect() } else { vec![c] };
            piece
        })
        .collect()
}

/// Whether `c` is printed escaped: a control character, or a mark that changes the direction or
/// order in which the text around it is shown.
fn hidden(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{61c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_length_is_bounded() {
        assert_eq!(clean("a\nb\u{1b}[31mc\td", 100), "a\\nb\\u{1b}[31mc\\td");
        assert_eq!(clean("plain ünïcode", 100), "plain ünïcode");
        let long = "é".repeat(1000);
        let cut = clean(&long, 11);
        assert!(cut.starts_with("ééééé…"), "{cut}");
        assert!(cut.ends_with("(1990 more bytes)"), "{cut}");
        assert_eq!(clean("", 0), "");
        assert_eq!(printable("a\n\tb\u{1b}[2J\r"), "a\n\tb\\u{1b}[2J\\r");
        // Shown as "order.cre" followed by "detaerc" reversed, were the override kept.
        assert_eq!(clean("order.cre\u{202e}detaerc", 100), "order.cre\\u{202e}detaerc");
        assert_eq!(printable("x\u{2067}y\u{200f}"), "x\\u{2067}y\\u{200f}");
    }
}
