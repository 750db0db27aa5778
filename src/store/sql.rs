//! The SQL text the store's queries share: `?` placeholders (numbered for PostgreSQL), the
//! few clauses that differ by dialect, integer lists and PostgreSQL arrays written as
//! literals, batches cut into statements of a few repeating shapes, statements sent as
//! text, and the small readers of rows (one by key, all, a page along an index).
//!
//! What it must never do: write into SQL text a value that would need quoting (only
//! integers and plain words are written as literals; everything else is bound), or know
//! the store's tables.

use sqlx::any::AnyRow;
use sqlx::Row;

use super::{Dialect, Store, StoreError};

/// Tells PostgreSQL's planner, for the rest of the transaction, to walk an index rather
/// than scan a sale and sort it (see `Store::keyset_rows`).
pub(crate) const PG_WALK_INDEXES: &str = "SELECT set_config('enable_seqscan', 'off', true), \
     set_config('enable_bitmapscan', 'off', true), set_config('enable_sort', 'off', true)";

/// Runs one statement without parameters, sent as text (MySQL's text protocol: nothing is
/// prepared on the server). A function of its own so that the future's lifetimes are
/// named: inside an async fn the compiler cannot prove the borrowed text's future `Send`.
pub(super) fn execute_text<'c>(
    conn: &'c mut sqlx::AnyConnection,
    sql: &'c str,
) -> std::pin::Pin<
    Box<
        dyn std::future::Future<Output = Result<sqlx::any::AnyQueryResult, sqlx::Error>>
            + Send
            + 'c,
    >,
> {
    use sqlx::Executor;
    conn.execute(sql)
}

/// Reads the rows of one statement without parameters, sent as text (see `execute_text`).
pub(super) fn fetch_text<'c>(
    conn: &'c mut sqlx::AnyConnection,
    sql: &'c str,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Vec<AnyRow>, sqlx::Error>> + Send + 'c>,
> {
    use sqlx::Executor;
    conn.fetch_all(sql)
}

/// Values as a comma-separated list (`1,2,3`): as SQL literals when they are integers, which
/// Rust writes, so nothing in them needs quoting; inside braces, a PostgreSQL array.
pub(super) fn literal_list<T: std::fmt::Display>(values: impl Iterator<Item = T>) -> String {
    use std::fmt::Write;
    let mut list = String::new();
    for (i, v) in values.enumerate() {
        let sep = if i == 0 { "" } else { "," };
        // Writing into a String cannot fail.
        let _ = write!(list, "{sep}{v}");
    }
    list
}

impl Store {
    /// Queries are written with `?` placeholders; PostgreSQL wants `$1, $2, ...`.
    pub(super) fn sql(&self, q: &str) -> String {
        if self.dialect != Dialect::Postgres {
            return q.to_string();
        }
        numbered_placeholders(q)
    }

    pub(super) fn placeholders(n: usize) -> String {
        vec!["?"; n].join(",")
    }

    /// Whether a statement of `rows` rows, cut by [`fixed_chunks`] at `max`, is worth
    /// preparing once and keeping: on SQLite, whose batches all run on the one write
    /// connection, a statement of a shape it sees again. The other servers prepare each
    /// on their side, per connection; they keep the one-use statements they had.
    pub(super) fn keeps_shape(&self, rows: usize, max: usize) -> bool {
        self.dialect == Dialect::Sqlite && (rows == max || rows.is_power_of_two())
    }

    /// `items` cut into statements of at most `max` rows: of the shapes kept, on SQLite.
    pub(super) fn statement_chunks<'a, T>(
        &self,
        items: &'a [T],
        max: usize,
    ) -> impl Iterator<Item = &'a [T]> {
        fixed_chunks(items, max, self.dialect == Dialect::Sqlite)
    }

    pub(super) fn insert_ignore(&self, table_and_cols: &str) -> String {
        match self.dialect {
            Dialect::MySql => format!("INSERT IGNORE INTO {table_and_cols}"),
            _ => format!("INSERT INTO {table_and_cols}"),
        }
    }

    pub(super) fn on_conflict_nothing(&self) -> &'static str {
        match self.dialect {
            Dialect::MySql => "",
            _ => " ON CONFLICT DO NOTHING",
        }
    }

    /// The row lock a read under a write transaction takes: none on SQLite, whose
    /// `BEGIN IMMEDIATE` has locked the whole file already.
    pub(super) fn for_update(&self) -> &'static str {
        match self.dialect {
            Dialect::Sqlite => "",
            _ => " FOR UPDATE",
        }
    }

    pub(super) fn sum_int(&self, expr: &str) -> String {
        match self.dialect {
            Dialect::MySql => format!("CAST(COALESCE(SUM({expr}),0) AS SIGNED)"),
            Dialect::Postgres => format!("CAST(COALESCE(SUM({expr}),0) AS BIGINT)"),
            Dialect::Sqlite => format!("COALESCE(SUM({expr}),0)"),
        }
    }

    /// Every row of `query` (`?` placeholders, bound to `keys` in order), each read by `map`.
    pub(crate) async fn all_rows<T>(
        &self,
        query: &str,
        keys: &[i64],
        map: fn(&AnyRow) -> Result<T, sqlx::Error>,
    ) -> Result<Vec<T>, StoreError> {
        let query = self.sql(query);
        let mut bound = sqlx::query(&query);
        for key in keys {
            bound = bound.bind(*key);
        }
        let rows = bound.fetch_all(&self.pool).await?;
        rows.iter().map(|r| map(r).map_err(Into::into)).collect()
    }

    /// A page read by keyset along an index (`WHERE sale_id = ? AND id > ? ORDER BY id
    /// LIMIT ?`). On PostgreSQL the planner is told, for this read only, to walk an index
    /// rather than scan and sort: its statistics lag a sale that grows by thousands of rows
    /// a second (the sale's id is new to them, so it believes the sale holds a few rows),
    /// and it read every order of the sale and sorted them for a page of 100 (276 ms at a
    /// million orders; 0.1 ms walking the index).
    pub(crate) async fn keyset_rows<T>(
        &self,
        query: &str,
        keys: &[i64],
        map: fn(&AnyRow) -> Result<T, sqlx::Error>,
    ) -> Result<Vec<T>, StoreError> {
        if self.dialect != Dialect::Postgres {
            return self.all_rows(query, keys, map).await;
        }
        let mut tx = self.begin_with("BEGIN READ ONLY").await?;
        sqlx::query(PG_WALK_INDEXES).execute(&mut *tx).await?;
        let query = self.sql(query);
        let mut bound = sqlx::query(&query);
        for key in keys {
            bound = bound.bind(*key);
        }
        let rows = bound.fetch_all(&mut *tx).await?;
        Self::finish(tx, false).await?;
        rows.iter().map(|r| map(r).map_err(Into::into)).collect()
    }

    /// The one row that `query` (with a single `?`, bound to `key`) selects, mapped.
    pub(crate) async fn one_by_key<T>(
        &self,
        query: &str,
        key: i64,
        map: fn(&AnyRow) -> Result<T, sqlx::Error>,
    ) -> Result<Option<T>, StoreError> {
        let row = sqlx::query(&self.sql(query))
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|r| map(&r)).transpose()?)
    }
}

/// `items` cut into statements of `max` rows, and what is left over into rows of powers of
/// two (1,000 and 733: 1,000, then 512, 128, 64, 16, 8, 4, 1), so that a batch of any size
/// runs statements of a dozen shapes, each prepared once (see `Store::keeps_shape`), not a
/// statement of a new shape, parsed anew, at the end of every batch. With `fixed` false,
/// plain chunks of `max`: where no shape is kept, a leftover is one statement, not several.
pub(crate) fn fixed_chunks<T>(items: &[T], max: usize, fixed: bool) -> impl Iterator<Item = &[T]> {
    let max = max.max(1);
    let mut rest = items;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let take = if rest.len() >= max {
            max
        } else if fixed {
            1 << rest.len().ilog2()
        } else {
            rest.len()
        };
        let (chunk, after) = rest.split_at(take);
        rest = after;
        Some(chunk)
    })
}

/// A row's first column, an integer (an id).
pub(crate) fn first_int(row: &AnyRow) -> Result<i64, sqlx::Error> {
    row.try_get(0)
}

/// A row's first two columns, integers: (user, units) and the like.
pub(crate) fn int_pair(row: &AnyRow) -> Result<(i64, i64), sqlx::Error> {
    Ok((row.try_get(0)?, row.try_get(1)?))
}

/// A row's first two columns: (a status, a count) and the like.
pub(crate) fn text_and_int(row: &AnyRow) -> Result<(String, i64), sqlx::Error> {
    Ok((row.try_get(0)?, row.try_get(1)?))
}

/// A PostgreSQL array literal (`{1,2,3}`), bound as text and cast in the statement: the
/// Any driver binds no arrays, and one array keeps one statement shape whatever the
/// batch's size. Only for items that need no quoting (integers, `NULL`, plain words).
pub(crate) fn pg_array<T: std::fmt::Display>(values: impl Iterator<Item = T>) -> String {
    format!("{{{}}}", literal_list(values))
}

/// `a = ? AND b = ?` becomes `a = $1 AND b = $2`. Our queries hold no literal `?`.
fn numbered_placeholders(q: &str) -> String {
    let mut out = String::with_capacity(q.len() + 16);
    let mut n = 0;
    for c in q.chars() {
        if c == '?' {
            n += 1;
            out.push('$');
            out.push_str(&n.to_string());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn a_batch_of_any_size_is_cut_into_a_few_repeating_statement_shapes() {
        let mut shapes = HashSet::new();
        for n in (0..3000).chain([7_400, 19_999, 20_000]) {
            let items: Vec<usize> = (0..n).collect();
            let chunks: Vec<&[usize]> = fixed_chunks(&items, 500, true).collect();
            let plain: Vec<&[usize]> = fixed_chunks(&items, 500, false).collect();
            assert_eq!(plain, items.chunks(500).collect::<Vec<_>>(), "{n}");
            // Every row once, in order, none empty.
            assert_eq!(chunks.concat(), items, "{n}");
            assert!(chunks.iter().all(|c| !c.is_empty()));
            // Whole statements first, then at most one of each smaller power of two.
            let sizes: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
            let whole = sizes.iter().take_while(|&&s| s == 500).count();
            assert_eq!(whole, n / 500, "{sizes:?}");
            let rest = &sizes[whole..];
            assert!(rest.windows(2).all(|w| w[0] > w[1]), "{sizes:?}");
            assert!(
                rest.iter().all(|s| s.is_power_of_two() && *s < 500),
                "{sizes:?}"
            );
            shapes.extend(sizes);
        }
        // 500 and 256, 128, ..., 1: ten statements ever, where there were 500.
        assert_eq!(shapes.len(), 10, "{shapes:?}");
    }

    #[test]
    fn postgres_placeholders_are_numbered() {
        assert_eq!(
            numbered_placeholders("a = ? AND b IN (?, ?)"),
            "a = $1 AND b IN ($2, $3)"
        );
    }
}
