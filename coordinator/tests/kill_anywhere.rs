//! Kill-anywhere: SIGKILL of a random process of a job (the coordinator, or one of its ranks)
//! at a random moment of a random job kind (`bench allreduce`, `decode --model`, the embedded
//! default decode). Every round must end with the right exit code (3 for a killed rank,
//! SIGKILL's own for the coordinator), no process of the round left (each round's processes
//! carry a tag in their environment, which ranks inherit), and nothing left in the round's
//! `$TMPDIR` / `$XDG_RUNTIME_DIR` or in /dev/shm.
//!
//! CI runs a few seeded rounds (the first six cover both victims in each job kind);
//! `scripts/kill_anywhere.sh` runs many: `TPRUN_KILL_ROUNDS` (default 6) and `TPRUN_KILL_SEED`
//! (default 1) choose them.

mod common;
use common::*;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// When kills land, after the job starts: half in the first [`EARLY_KILL_MS`], half anywhere
/// up to [`LATEST_KILL_MS`]. Jobs of these kinds have every rank at work after 80–130 ms on
/// the 2-core development machine (the first 50-round run: kills at 17–24 ms found ranks in
/// start-up, at 85 ms in loading, from 135 ms in decode), so the early half is spread over
/// start-up, rendezvous, setup and loading.
const EARLY_KILL_MS: u64 = 120;
const LATEST_KILL_MS: u64 = 900;
/// How long a round's processes may take to vanish after the coordinator's exit (ranks of a
/// killed coordinator die by PDEATHSIG, asynchronously).
const GONE_WITHIN: Duration = Duration::from_secs(5);

/// splitmix64: a seeded generator with no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Bench,
    DecodeModel,
    DecodeDefault,
}

const KINDS: [Kind; 3] = [Kind::Bench, Kind::DecodeModel, Kind::DecodeDefault];

#[derive(Clone, Copy, Debug)]
enum Victim {
    Coordinator,
    Rank(usize),
}

/// The job's arguments: each runs far longer than [`LATEST_KILL_MS`], so the kill finds it
/// running.
fn job_args(kind: Kind, world: usize, model: &Path) -> Vec<String> {
    let mut a: Vec<String> = ["--ranks", &world.to_string(), "--timeout", "30"]
        .map(String::from)
        .to_vec();
    let rest: &[&str] = match kind {
        Kind::Bench => &[
            "bench",
            "allreduce",
            "--sizes",
            "64K",
            "--algo",
            "oneshot",
            "--iters",
            "100000000",
            "--warmup",
            "0",
        ],
        Kind::DecodeModel => &["decode", "--model", "MODEL"],
        Kind::DecodeDefault => &["decode"],
    };
    a.extend(rest.iter().map(|s| s.to_string()));
    if let Some(m) = a.iter_mut().find(|s| *s == "MODEL") {
        *m = model.to_string_lossy().into_owned();
    }
    if !matches!(kind, Kind::Bench) {
        a.extend(
            [
                "--ignore-eos",
                "--max-new-tokens",
                "60000",
                "--max-seq",
                "65536",
            ]
            .map(String::from),
        );
    }
    a
}

/// Processes whose environment holds `tag` (`NAME=value`).
fn tagged(tag: &str) -> Vec<u32> {
    let needle = tag.as_bytes();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| alive(pid))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == needle))
        })
        .collect()
}

/// Entries of /dev/shm that look like ours.
fn shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.to_lowercase().contains("tprun"))
                .collect()
        })
        .unwrap_or_default()
}

/// The pid of rank `r` of coordinator `coord`, once it has been started.
fn rank_pid(coord: u32, r: usize) -> Option<u32> {
    children(coord).into_iter().find_map(|(pid, cmd)| {
        let mut it = cmd.split_whitespace();
        it.find(|w| *w == "--rank")?;
        (it.next()?.parse::<usize>().ok()? == r).then_some(pid)
    })
}

/// What one round saw; `problems` is empty for a clean round.
struct Outcome {
    line: String,
    problems: Vec<String>,
}

fn round(
    i: usize,
    kind: Kind,
    victim: Victim,
    world: usize,
    at: Duration,
    model: &Path,
) -> Outcome {
    let env = Env::new(&format!("kill-{i}"));
    let round_id = format!("{}-{i}", std::process::id());
    let tag = format!("TPRUN_KILL_ROUND={round_id}");
    let shm_before = shm_entries();
    let mut cmd = env.cmd();
    cmd.args(job_args(kind, world, model))
        .env("TPRUN_KILL_ROUND", &round_id)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child: Child = cmd.spawn().unwrap();
    let coord = child.id();
    let t0 = Instant::now();
    std::thread::sleep(at);
    // A rank not started yet at the chosen moment is killed as soon as it is.
    let target = match victim {
        Victim::Coordinator => Some(coord),
        Victim::Rank(r) => loop {
            if let Some(p) = rank_pid(coord, r) {
                break Some(p);
            }
            if t0.elapsed() > Duration::from_secs(20) || child.try_wait().unwrap().is_some() {
                break None;
            }
            std::thread::sleep(Duration::from_millis(1));
        },
    };
    let killed_at = t0.elapsed();
    if let Some(p) = target {
        let _ = kill(Pid::from_raw(p as i32), Signal::SIGKILL);
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let mut problems = Vec::new();
    let status = out.status;
    match victim {
        Victim::Coordinator if status.signal() != Some(Signal::SIGKILL as i32) => {
            problems.push(format!("coordinator ended with {status:?}, not SIGKILL"))
        }
        Victim::Rank(r) => {
            if status.code() != Some(3) {
                problems.push(format!("exit {status:?}, expected 3"));
            } else if !err.contains(&format!("error: rank {r} (pid")) || !err.contains("SIGKILL") {
                problems.push(format!(
                    "the error does not name rank {r} killed by SIGKILL"
                ));
            }
        }
        _ => {}
    }
    if err.contains("panicked") {
        problems.push("panic text on stderr".into());
    }
    let t_gone = Instant::now();
    let mut left = tagged(&tag);
    while !left.is_empty() && t_gone.elapsed() < GONE_WITHIN {
        std::thread::sleep(Duration::from_millis(10));
        left = tagged(&tag);
    }
    if !left.is_empty() {
        problems.push(format!("processes left: {left:?}"));
        for p in &left {
            let _ = kill(Pid::from_raw(*p as i32), Signal::SIGKILL);
        }
    }
    let files: Vec<PathBuf> = std::fs::read_dir(&env.dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    if !files.is_empty() {
        problems.push(format!("files left: {files:?}"));
    }
    let new_shm: Vec<String> = shm_entries()
        .into_iter()
        .filter(|n| !shm_before.contains(n))
        .collect();
    if !new_shm.is_empty() {
        problems.push(format!("new in /dev/shm: {new_shm:?}"));
    }
    // Where the kill landed, as the coordinator saw it ("... during loading").
    let phase = err
        .lines()
        .find_map(|l| l.strip_prefix("error: ")?.split(" during ").nth(1))
        .map_or(String::new(), |p| format!(" during {}", p.trim()));
    let who = match victim {
        Victim::Coordinator => "the coordinator".to_string(),
        Victim::Rank(r) => format!("rank {r}"),
    };
    let line = format!(
        "round {i}: {kind:?} on {world} ranks, SIGKILL {who} at {} ms{phase} -> {}",
        killed_at.as_millis(),
        match (status.code(), status.signal()) {
            (Some(c), _) => format!("exit {c}"),
            (_, Some(s)) => format!("signal {s}"),
            _ => "?".into(),
        }
    );
    if !problems.is_empty() {
        eprintln!("round {i} stderr:\n{err}");
    }
    Outcome { line, problems }
}

/// A model folder for `decode --model`: the shared TinyStories checkpoint when it is there,
/// else a tiny synthetic one written into `scratch`.
fn decode_model(scratch: &Path) -> PathBuf {
    if let Some(m) = shared_model() {
        return m;
    }
    let dir = scratch.join("model");
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_tprun"));
    c.args(["synth", "--out", dir.to_str().unwrap(), "--dtype", "f32"]);
    run_ok(c, "synth");
    dir
}

#[test]
fn sigkill_anywhere_leaves_the_right_exit_code_and_nothing_behind() {
    let var = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let rounds = var("TPRUN_KILL_ROUNDS", 6) as usize;
    let seed = var("TPRUN_KILL_SEED", 1);
    let scratch = Env::new("kill-scratch");
    let model = decode_model(&scratch.dir);
    let mut rng = Rng(seed);
    // The first six rounds: each job kind with each victim, in a seeded order.
    let mut grid: Vec<(Kind, bool)> = KINDS
        .iter()
        .flat_map(|&k| [(k, true), (k, false)])
        .collect();
    for j in (1..grid.len()).rev() {
        grid.swap(j, rng.below(j as u64 + 1) as usize);
    }
    let mut unclean = Vec::new();
    for i in 0..rounds {
        let (kind, coordinator) = grid.get(i).copied().unwrap_or_else(|| {
            (
                KINDS[rng.below(KINDS.len() as u64) as usize],
                rng.below(2) == 0,
            )
        });
        let world = [2, 4][rng.below(2) as usize];
        let victim = if coordinator {
            Victim::Coordinator
        } else {
            Victim::Rank(rng.below(world as u64) as usize)
        };
        let latest = if rng.below(2) == 0 {
            EARLY_KILL_MS
        } else {
            LATEST_KILL_MS
        };
        let at = Duration::from_millis(rng.below(latest + 1));
        let o = round(i, kind, victim, world, at, &model);
        if o.problems.is_empty() {
            println!("{}: clean", o.line);
        } else {
            println!("{}: UNCLEAN: {}", o.line, o.problems.join("; "));
            unclean.push(o.line);
        }
    }
    println!(
        "{rounds} rounds (seed {seed}): {} clean",
        rounds - unclean.len()
    );
    assert!(unclean.is_empty(), "unclean rounds: {unclean:#?}");
}
