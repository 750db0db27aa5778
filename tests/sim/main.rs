//! A deterministic simulation of the embedded pipeline, after TigerBeetle's simulator: the
//! product's own memory gate (behind its sold-out shortcut), order log, writer, lifecycle
//! and scheduler on SQLite, on a simulated disk and a simulated clock, driven by a seed.
//! Each seed draws its regime (buyers, sales, how often the disk fails or the process dies)
//! and then its steps: purchases in bursts, the log's group commits, writer batches,
//! payments, cancels (some by the wrong buyer), time passing past payment deadlines,
//! scheduler passes, SQLite locked by another process (real busy errors), and crashes:
//! between steps, in an append or a sync of the log (torn: part of the bytes written), just
//! before or just after a SQL commit. After a crash the disk keeps what was synced and a
//! random prefix of the rest, and a new process starts as a server does. After every step
//! the invariants of docs/ARCHITECTURE.md are checked (`check`); at the end, faults stop,
//! the log drains, and every `ok` must be in SQL, the gate equal to SQL, and stock that
//! came back must sell again.
//!
//! `cargo test --test sim` runs `SECKILL_SIM_SEEDS` seeds (default 250) from a start
//! drawn at random and printed. A failing seed prints itself and its last steps;
//! `SECKILL_SIM_SEED=<seed>` runs that seed alone, exactly as it ran (the replay test
//! checks that a seed's trace is the same twice). The long run is `scripts/simulate`.

mod check;
mod disk;
mod run;
mod world;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Steps per seed: enough for several crashes and restarts in the faulty regimes.
fn steps() -> usize {
    std::env::var("SECKILL_SIM_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(150)
}

/// Runs one seed on a runtime of its own (one thread: the order of everything is the
/// seed's alone).
fn simulate(seed: u64) -> Result<run::Report, run::Failure> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runtime.block_on(async { run::Sim::new(seed).await.run(steps()).await })
    }));
    outcome.unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".into());
        Err(run::Failure {
            step: 0,
            what: format!("panicked: {what}"),
            trace: Vec::new(),
        })
    })
}

fn report(seed: u64, failure: &run::Failure) -> String {
    let tail: Vec<&String> = failure.trace.iter().rev().take(40).collect();
    let mut out = format!(
        "\nSECKILL_SIM_SEED={seed} failed at step {}: {}\nlast steps:\n",
        failure.step, failure.what
    );
    for line in tail.into_iter().rev() {
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[test]
fn seeds_keep_every_invariant() {
    if let Some(seed) = std::env::var("SECKILL_SIM_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        match simulate(seed) {
            Ok(r) => {
                for line in &r.trace {
                    println!("{line}");
                }
                println!("SECKILL_SIM_SEED={seed}: passed {:?}", r.tally);
            }
            Err(f) => panic!("{}", report(seed, &f)),
        }
        return;
    }
    let seeds: u64 = std::env::var("SECKILL_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(250);
    let start: u64 = std::env::var("SECKILL_SIM_START")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!(
        "simulating seeds {start}..{} (SECKILL_SIM_START={start})",
        start.wrapping_add(seeds)
    );
    let next = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(Mutex::new(Vec::new()));
    let totals = Arc::new(Mutex::new(run::Tally::default()));
    let done = Arc::new(AtomicUsize::new(0));
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let (next, failures, totals, done) =
                (next.clone(), failures.clone(), totals.clone(), done.clone());
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= seeds || !failures.lock().unwrap().is_empty() {
                    return;
                }
                let seed = start.wrapping_add(i);
                match simulate(seed) {
                    Ok(r) => {
                        let mut t = totals.lock().unwrap();
                        t.steps += r.tally.steps;
                        t.ok += r.tally.ok;
                        t.refused += r.tally.refused;
                        t.pending_or_unanswered += r.tally.pending_or_unanswered;
                        t.crashes += r.tally.crashes;
                        t.failed_boots += r.tally.failed_boots;
                        t.written += r.tally.written;
                        t.paid += r.tally.paid;
                        t.cancelled += r.tally.cancelled;
                        t.busy_periods += r.tally.busy_periods;
                        t.expired += r.tally.expired;
                        let finished = done.fetch_add(1, Ordering::SeqCst) + 1;
                        if finished % 1000 == 0 {
                            println!("{finished} seeds passed");
                        }
                    }
                    Err(f) => failures.lock().unwrap().push(report(seed, &f)),
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a simulation thread");
    }
    let failures = failures.lock().unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    println!(
        "{} seeds passed: {:?}",
        done.load(Ordering::SeqCst),
        totals.lock().unwrap()
    );
}

/// The same seed twice gives the same run, step for step: a failure found once can be
/// replayed and debugged.
#[test]
fn a_seed_replays_exactly() {
    let seed = std::env::var("SECKILL_SIM_START")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_261_125);
    let mut traces = Vec::new();
    for _ in 0..2 {
        match simulate(seed) {
            Ok(r) => traces.push(r.trace),
            Err(f) => panic!("{}", report(seed, &f)),
        }
    }
    assert!(traces[0].len() > 100, "a run of substance");
    if let Some(at) = (0..traces[0].len()).find(|i| traces[0].get(*i) != traces[1].get(*i)) {
        panic!(
            "seed {seed} ran differently the second time, from line {at}:\n{:?}\n{:?}",
            traces[0].get(at),
            traces[1].get(at)
        );
    }
    assert_eq!(traces[0].len(), traces[1].len());
}
