//! The process's open-file limit: every client connection, Redis and database connection
//! is a file descriptor, and a soft limit of 1,024 (a common default) would refuse
//! connections long before `--max-connections`. Raised to the hard limit at start.

/// Raises the soft open-file limit to the hard one; returns (before, after), or `None`
/// when the limit cannot be read.
pub fn raise_to_hard_limit() -> Option<(u64, u64)> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a pointer to a live, owned value.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return None;
    }
    let before = limit.rlim_cur;
    if limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: setrlimit reads one rlimit through a pointer to a live, owned value.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            return Some((before, before));
        }
    }
    Some((before, limit.rlim_cur))
}

/// Says in the log what the limit is, and warns when it is below what the configuration
/// may open at once.
pub fn raise_and_report(may_open: u64) {
    match raise_to_hard_limit() {
        Some((before, after)) if after < may_open => tracing::warn!(
            before,
            after,
            may_open,
            "the open-file limit is below the connections this server may open at once: raise its hard limit (systemd: LimitNOFILE) or lower --max-connections"
        ),
        Some((before, after)) if before != after => {
            tracing::info!(before, after, "open-file limit raised to its hard limit")
        }
        Some((_, after)) => tracing::info!(limit = after, "open-file limit"),
        None => tracing::warn!("cannot read the open-file limit"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_soft_limit_ends_at_the_hard_limit() {
        let (before, after) = super::raise_to_hard_limit().expect("readable");
        assert!(after >= before);
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: as above.
        assert_eq!(
            unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
            0
        );
        assert_eq!(limit.rlim_cur, limit.rlim_max);
        assert_eq!(limit.rlim_cur, after);
    }
}
