//! The median and range of a benchmark's rounds. On a shared machine one measurement moves by more
//! than the differences a benchmark is after, so the benchmarks repeat theirs in rounds and report
//! each figure as the median of the rounds with the lowest and highest beside it.

/// The median, lowest and highest of a set of measurements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub low: f64,
    pub high: f64,
}

impl Spread {
    /// The spread of `values`: the median is the mean of the middle two when their number is
    /// even. Panics on no values, which no benchmark has (each runs at least one round).
    pub fn of(values: impl IntoIterator<Item = f64>) -> Spread {
        let mut values: Vec<f64> = values.into_iter().collect();
        assert!(!values.is_empty(), "a spread of no measurements");
        values.sort_by(f64::total_cmp);
        let n = values.len();
        let median = if n % 2 == 1 { values[n / 2] } else { (values[n / 2 - 1] + values[n / 2]) / 2.0 };
        Spread { median, low: values[0], high: values[n - 1] }
    }

    /// `[low, high]` rounded to thousandths, as the benchmarks' JSON reports give ranges.
    pub fn range_json(&self) -> serde_json::Value {
        serde_json::json!([thousandths(self.low), thousandths(self.high)])
    }
}

/// The line under a benchmark's table that says how its figures were taken from `rounds` rounds.
pub fn rounds_note(rounds: u32) -> String {
    format!(
        "median of {rounds} rounds: each rate is the median of its own, each ratio the median of the rounds' own \
         ratios (with their range), so a ratio need not equal the quotient of the rates beside it"
    )
}

/// `x` rounded to three decimal places: how the reports give ratios and milliseconds.
pub fn thousandths(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_and_even_counts_and_unsorted_input() {
        assert_eq!(Spread::of([3.0, 1.0, 2.0]), Spread { median: 2.0, low: 1.0, high: 3.0 });
        assert_eq!(Spread::of([4.0, 1.0, 3.0, 2.0]), Spread { median: 2.5, low: 1.0, high: 4.0 });
        assert_eq!(Spread::of([0.7]), Spread { median: 0.7, low: 0.7, high: 0.7 });
    }

    #[test]
    fn ranges_are_rounded_to_thousandths() {
        assert_eq!(Spread::of([0.12345, 0.98765]).range_json(), serde_json::json!([0.123, 0.988]));
    }
}
