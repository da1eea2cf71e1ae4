//! Times as CloudEvents and most protocols write them, without a date library.

/// The first and last milliseconds RFC 3339 can write: years 1 to 9999.
const RANGE: std::ops::RangeInclusive<i64> = -62_135_596_800_000..=253_402_300_799_999;

/// Milliseconds since the Unix epoch as an RFC 3339 UTC time, e.g. `2026-11-27T08:00:00.250Z`;
/// `None` outside the years 1 to 9999, which RFC 3339 cannot write.
pub fn rfc3339_millis(ms: i64) -> Option<String> {
    if !RANGE.contains(&ms) {
        return None;
    }
    let (days, ms_of_day) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000));
    // Days to a civil date (proleptic Gregorian), after Howard Hinnant's `civil_from_days`.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s, milli) = (ms_of_day / 3_600_000, ms_of_day / 60_000 % 60, ms_of_day / 1000 % 60, ms_of_day % 1000);
    Some(format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{milli:03}Z"))
}

#[cfg(test)]
mod tests {
    use super::rfc3339_millis;

    #[test]
    fn times_are_rfc3339() {
        let time = |ms| rfc3339_millis(ms).unwrap_or_default();
        assert_eq!(time(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(time(1_795_766_400_250), "2026-11-27T08:00:00.250Z");
        assert_eq!(time(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(time(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(time(-62_135_596_800_000), "0001-01-01T00:00:00.000Z");
        assert_eq!(time(253_402_300_799_999), "9999-12-31T23:59:59.999Z");
        assert_eq!(rfc3339_millis(253_402_300_800_000), None, "year 10000");
        assert_eq!(rfc3339_millis(-62_135_596_800_001), None, "year 0");
        assert_eq!(rfc3339_millis(i64::MIN), None);
    }
}
