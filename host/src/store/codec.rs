//! How column values become ferry's types, on both backends, so rows derive `FromRow` (the
//! claimed row implements `FromRow` itself, by position, with these types): times (TIMESTAMPTZ on
//! PostgreSQL, integer milliseconds on SQLite), counts (checked to fit), and the text enums
//! (status, failure reason, attempt outcome).
//!
//! Every decoder refuses what ferry cannot represent (an `infinity` timestamp, a count of 2^63)
//! with an error naming the value, never a panic: rows are untrusted data.

use chrono::{DateTime, Utc};
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgTypeInfo, PgValueFormat, PgValueRef};
use sqlx::sqlite::{SqliteTypeInfo, SqliteValueRef};
use sqlx::{Decode, Postgres, Sqlite, Type, ValueRef as _};

/// A stored point in time. Decode a column with `#[sqlx(try_from = "DbTime")]` on a
/// `DateTime<Utc>` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DbTime(pub DateTime<Utc>);

/// A nullable stored time, for `Option<DateTime<Utc>>` fields (`try_from = "MaybeTime"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaybeTime(pub Option<DateTime<Utc>>);

/// A stored non-negative count that must fit a `u32` (`try_from = "Count"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count(pub u32);

/// A nullable count, for `Option<u32>` fields (`try_from = "MaybeCount"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaybeCount(pub Option<u32>);

impl From<DbTime> for DateTime<Utc> {
    fn from(t: DbTime) -> Self {
        t.0
    }
}

impl From<MaybeTime> for Option<DateTime<Utc>> {
    fn from(t: MaybeTime) -> Self {
        t.0
    }
}

impl From<Count> for u32 {
    fn from(n: Count) -> Self {
        n.0
    }
}

impl From<MaybeCount> for Option<u32> {
    fn from(n: MaybeCount) -> Self {
        n.0
    }
}

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

fn from_millis(ms: i64) -> Result<DbTime, BoxDynError> {
    DateTime::from_timestamp_millis(ms).map(DbTime).ok_or_else(|| format!("{ms} ms is out of range for a time").into())
}

fn count(n: i64) -> Result<Count, BoxDynError> {
    u32::try_from(n).map(Count).map_err(|_| format!("{n} is not a count between 0 and {}", u32::MAX).into())
}

impl Type<Sqlite> for DbTime {
    fn type_info() -> SqliteTypeInfo {
        <i64 as Type<Sqlite>>::type_info()
    }
    fn compatible(ty: &SqliteTypeInfo) -> bool {
        <i64 as Type<Sqlite>>::compatible(ty)
    }
}

impl<'r> Decode<'r, Sqlite> for DbTime {
    fn decode(value: SqliteValueRef<'r>) -> Result<Self, BoxDynError> {
        from_millis(<i64 as Decode<Sqlite>>::decode(value)?)
    }
}

impl Type<Postgres> for DbTime {
    fn type_info() -> PgTypeInfo {
        <DateTime<Utc> as Type<Postgres>>::type_info()
    }
    fn compatible(ty: &PgTypeInfo) -> bool {
        <DateTime<Utc> as Type<Postgres>>::compatible(ty)
    }
}

impl<'r> Decode<'r, Postgres> for DbTime {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        match value.format() {
            PgValueFormat::Binary => {
                // `infinity` and `-infinity` are i64::MAX and i64::MIN here; chrono would overflow.
                let micros = <i64 as Decode<Postgres>>::decode(value)?;
                micros
                    .checked_add(PG_EPOCH_MICROS)
                    .and_then(DateTime::from_timestamp_micros)
                    .map(DbTime)
                    .ok_or_else(|| "the time is infinite or out of range".into())
            }
            PgValueFormat::Text => {
                let text = value.as_str()?;
                if text.contains("infinity") {
                    return Err(format!("the time {text:?} is not a point in time").into());
                }
                <DateTime<Utc> as Decode<Postgres>>::decode(value).map(DbTime)
            }
        }
    }
}

impl Type<Sqlite> for Count {
    fn type_info() -> SqliteTypeInfo {
        <i64 as Type<Sqlite>>::type_info()
    }
    fn compatible(ty: &SqliteTypeInfo) -> bool {
        <i64 as Type<Sqlite>>::compatible(ty)
    }
}

impl<'r> Decode<'r, Sqlite> for Count {
    fn decode(value: SqliteValueRef<'r>) -> Result<Self, BoxDynError> {
        count(<i64 as Decode<Sqlite>>::decode(value)?)
    }
}

impl Type<Postgres> for Count {
    fn type_info() -> PgTypeInfo {
        <i32 as Type<Postgres>>::type_info()
    }
    fn compatible(ty: &PgTypeInfo) -> bool {
        <i32 as Type<Postgres>>::compatible(ty) || <i64 as Type<Postgres>>::compatible(ty)
    }
}

impl<'r> Decode<'r, Postgres> for Count {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        if <i64 as Type<Postgres>>::compatible(&value.type_info()) {
            return count(<i64 as Decode<Postgres>>::decode(value)?);
        }
        count(i64::from(<i32 as Decode<Postgres>>::decode(value)?))
    }
}

/// A column read for display, whatever it holds: the value when it decodes as `T`, else why it
/// does not. Inspection (`ferry show`, lists) uses it so one unreadable column does not hide the
/// rest of the row, or fail a whole page.
#[derive(Debug, Clone, PartialEq)]
pub struct Lenient<T>(pub Result<T, String>);

impl<T> Lenient<T> {
    /// The value, or `fallback` with the reason added to `defects` under `column`.
    pub fn or(self, column: &str, fallback: T, defects: &mut Vec<String>) -> T {
        self.0.unwrap_or_else(|why| {
            defects.push(format!("{column} cannot be read: {why}"));
            fallback
        })
    }
}

impl<DB: sqlx::Database, T: Type<DB>> Type<DB> for Lenient<T> {
    fn type_info() -> DB::TypeInfo {
        T::type_info()
    }
    fn compatible(_: &DB::TypeInfo) -> bool {
        // Anything is accepted here; a mismatch becomes the reason in `decode`.
        true
    }
}

impl<'r, DB: sqlx::Database, T: Decode<'r, DB> + Type<DB>> Decode<'r, DB> for Lenient<T> {
    fn decode(value: <DB as sqlx::Database>::ValueRef<'r>) -> Result<Self, BoxDynError> {
        if !value.is_null() {
            let ty = value.type_info();
            if !T::compatible(&ty) {
                return Ok(Lenient(Err(format!("it holds {} data", sqlx::TypeInfo::name(&*ty)))));
            }
        }
        Ok(Lenient(T::decode(value).map_err(|e| e.to_string())))
    }
}

/// `Maybe*` wrappers: NULL is `None`, anything else decodes as the inner type.
macro_rules! nullable {
    ($maybe:ident, $inner:ident) => {
        impl<DB: sqlx::Database> Type<DB> for $maybe
        where
            $inner: Type<DB>,
        {
            fn type_info() -> DB::TypeInfo {
                <$inner as Type<DB>>::type_info()
            }
            fn compatible(ty: &DB::TypeInfo) -> bool {
                <$inner as Type<DB>>::compatible(ty)
            }
        }

        impl<'r, DB: sqlx::Database> Decode<'r, DB> for $maybe
        where
            $inner: Decode<'r, DB>,
        {
            fn decode(value: <DB as sqlx::Database>::ValueRef<'r>) -> Result<Self, BoxDynError> {
                if value.is_null() {
                    return Ok($maybe(None));
                }
                <$inner as Decode<'r, DB>>::decode(value).map(|v| $maybe(Some(v.0)))
            }
        }
    };
}

nullable!(MaybeTime, DbTime);
nullable!(MaybeCount, Count);

/// Implements `Type` and `Decode` for an enum stored as text, through its `FromStr`.
macro_rules! text_enum {
    ($($t:ty),*) => {$(
        impl<DB: sqlx::Database> Type<DB> for $t
        where
            str: Type<DB>,
        {
            fn type_info() -> DB::TypeInfo {
                <str as Type<DB>>::type_info()
            }
            fn compatible(ty: &DB::TypeInfo) -> bool {
                <str as Type<DB>>::compatible(ty)
            }
        }

        impl<'r, DB: sqlx::Database> Decode<'r, DB> for $t
        where
            &'r str: Decode<'r, DB>,
        {
            fn decode(value: <DB as sqlx::Database>::ValueRef<'r>) -> Result<Self, BoxDynError> {
                let text = <&'r str as Decode<'r, DB>>::decode(value)?;
                text.parse::<$t>().map_err(Into::into)
            }
        }
    )*};
}

text_enum!(crate::event::Status, crate::event::FailureReason, crate::event::AttemptOutcome);
