//! Host memory for jobs on the CPU backend, whose ranks all live in this host's memory: what
//! they would need is checked against what is available before any rank starts (the kernel's
//! OOM killer met it mid-load otherwise, and the job ended with "killed by SIGKILL").

use tprun_rank::model::{shard_memory, LoadOptions, ModelConfig};

use crate::launch::JobError;

/// Host memory this process may still use, in bytes: MemAvailable from /proc/meminfo, or less
/// where a cgroup (v2: a container) limits it; None where neither can be read.
pub fn available_bytes() -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let mem = read("/proc/meminfo").and_then(|text| {
        let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    });
    let number = |p: &str| read(p)?.trim().parse::<u64>().ok(); // "max" gives None
    let cgroup = number("/sys/fs/cgroup/memory.max")
        .map(|max| max.saturating_sub(number("/sys/fs/cgroup/memory.current").unwrap_or(0)));
    match (mem, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// `world` CPU ranks loading `cfg` with `opts` (matrices `wsize` bytes an element) against
/// `available` bytes of host memory: an error with the figures where they do not fit.
pub fn check_model(
    cfg: &ModelConfig,
    opts: &LoadOptions,
    wsize: usize,
    world: usize,
    available: u64,
) -> Result<(), JobError> {
    let (mut weights, mut state) = (0u64, 0u64);
    for rank in 0..world {
        let (w, s) = shard_memory(cfg, rank, world, opts, wsize)
            .map_err(|e| JobError::Setup(anyhow::anyhow!("{e}")))?;
        weights += w;
        state = state.saturating_add(s);
    }
    let need = weights.saturating_add(state);
    if need <= available {
        return Ok(());
    }
    let remedy = if state >= weights && opts.slots > 1 {
        "a smaller --max-seq or --max-batch, or --kv-dtype bf16, needs less"
    } else if state >= weights {
        "a smaller --max-seq or --kv-dtype bf16 needs less"
    } else if wsize > 2 {
        "--dtype bf16 needs less"
    } else {
        "the weights alone are more than this host has free"
    };
    Err(JobError::Setup(anyhow::anyhow!(
        "{world} CPU rank(s) need about {:.2} GiB of host memory for this model ({:.2} GiB of \
         weights, {:.2} GiB of KV cache and scratch) and {:.2} GiB are available (MemAvailable, \
         or the cgroup's limit): {remedy}",
        gib(need),
        gib(weights),
        gib(state),
        gib(available)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tprun_rank::model::synth::config_for;

    /// The embedded default model's shapes.
    fn tiny() -> ModelConfig {
        config_for(&crate::decode::DEFAULT_MODEL)
    }

    #[test]
    fn the_job_needs_every_ranks_shard() {
        let cfg = tiny();
        let opts = LoadOptions::default();
        let one = |r, w| {
            let (a, b) = shard_memory(&cfg, r, w, &opts, 4).unwrap();
            a + b
        };
        let two = one(0, 2) + one(1, 2);
        // Exactly enough fits; a byte less is refused with the figures.
        check_model(&cfg, &opts, 4, 2, two).unwrap();
        let e = check_model(&cfg, &opts, 4, 2, two - 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("2 CPU rank(s)") && e.contains("host memory"),
            "{e}"
        );
        // A longer cache needs more, and so does a wider KV dtype.
        let long = LoadOptions {
            max_seq: Some(100_000),
            ..LoadOptions::default()
        };
        assert!(check_model(&cfg, &long, 4, 2, two).is_err());
        let (w1, s1) = shard_memory(&cfg, 0, 1, &opts, 4).unwrap();
        let (w2, s2) = shard_memory(&cfg, 0, 1, &opts, 2).unwrap();
        assert!(w2 < w1 && s2 == s1);
    }
}
