//! `tprun bench allreduce`: builds the rows, runs the job, and prints the nccl-tests table
//! (or JSON). algbw = bytes / time; busbw = algbw × 2(n−1)/n (nccl-tests' PERFORMANCE.md).

use std::io::Write;

use anyhow::{bail, Result};
use serde::Serialize;
use tprun_kernels::comm::CommLayout;
use tprun_kernels::DType;
use tprun_rank::job::{Algo, Backend, BenchRow, BenchSpec, Report, Task};

use crate::cli::BenchAllreduceArgs;
use crate::launch::{JobError, Observer};
use crate::{hostmem, Settings};

/// Iterations when --iters is not given: enough for a stable median on small messages,
/// about 32 MiB of traffic per rank per row for large ones, never fewer than 5.
fn default_iters(bytes: usize) -> u32 {
    ((32usize << 20) / bytes.max(1)).clamp(5, 100) as u32
}

/// The rows of the job: every dtype × algorithm × size. The flags' numbers were bounded as
/// they were parsed (cli.rs, sizes.rs); this checks the names and how the flags combine.
pub fn rows(args: &BenchAllreduceArgs) -> Result<Vec<BenchRow>> {
    let algos: Vec<Algo> = if args.tune {
        vec![Algo::Oneshot, Algo::Twoshot]
    } else if args.algo.iter().any(|a| a == "all") {
        Algo::ALL.to_vec()
    } else {
        args.algo
            .iter()
            .map(|a| {
                Algo::parse(a).ok_or_else(|| {
                    anyhow::anyhow!("unknown --algo '{a}' (host, oneshot, twoshot, auto, all)")
                })
            })
            .collect::<Result<_>>()?
    };
    // `all` anywhere in the list: every dtype.
    let dtypes: Vec<DType> = args
        .dtype
        .iter()
        .map(|d| crate::dtype_arg("--dtype", d, &["all"]).map_err(|e| anyhow::anyhow!(e)))
        .collect::<Result<Option<_>>>()?
        .unwrap_or_else(|| DType::ALL.to_vec());
    let mut rows = Vec::new();
    for &dtype in &dtypes {
        let counts: Vec<usize> = match &args.counts {
            Some(c) => c.clone(),
            None => args
                .sizes
                .0
                .iter()
                .map(|b| b / dtype.size())
                .filter(|&c| c > 0)
                .collect(),
        };
        for &algo in &algos {
            for &count in &counts {
                let iters = args
                    .iters
                    .unwrap_or_else(|| default_iters(count * dtype.size()));
                rows.push(BenchRow {
                    algo,
                    dtype,
                    count,
                    warmup: args.warmup.unwrap_or((iters / 10).max(2)),
                    iters,
                });
            }
        }
    }
    if rows.is_empty() {
        bail!("no --sizes to run (every size is smaller than one element)");
    }
    Ok(rows)
}

/// Per dtype, the largest size up to which oneshot beat twoshot at every size (median per
/// call, or per graph replay where measured); `None` when twoshot won at the smallest.
fn tune(rows: &[RowOut]) -> std::collections::BTreeMap<&'static str, Option<usize>> {
    let mut out = std::collections::BTreeMap::new();
    for dtype in DType::ALL.map(DType::name) {
        let time = |algo: &str, bytes: usize| {
            rows.iter()
                .find(|r| r.dtype == dtype && r.algo == algo && r.bytes == bytes)
                .map(|r| r.graph_us.unwrap_or(r.time_median_us))
        };
        let mut sizes: Vec<usize> = rows
            .iter()
            .filter(|r| r.dtype == dtype)
            .map(|r| r.bytes)
            .collect();
        if sizes.is_empty() {
            continue;
        }
        sizes.sort_unstable();
        sizes.dedup();
        let mut best = None;
        for b in sizes {
            match (time("oneshot", b), time("twoshot", b)) {
                (Some(o), Some(t)) if o <= t => best = Some(b),
                _ => break,
            }
        }
        out.insert(dtype, best);
    }
    out
}

#[derive(Serialize)]
struct RowOut {
    bytes: usize,
    count: usize,
    dtype: &'static str,
    algo: &'static str,
    resolved: &'static str,
    time_median_us: f64,
    time_p99_us: f64,
    algbw_gbps: f64,
    busbw_gbps: f64,
    /// Per call when replayed from a device graph (slowest rank), where capturable.
    graph_us: Option<f64>,
    wrong: u64,
}

/// One rank's result for one row: the algorithm it ran, per-iteration µs, wrong elements.
type RankRow = (Algo, Vec<f32>, u64, Option<f32>);

struct Collector {
    world: usize,
    rows: Vec<BenchRow>,
    /// Per row: each rank's report.
    got: Vec<Vec<Option<RankRow>>>,
    out: Vec<RowOut>,
    json: bool,
    printed_header: bool,
    /// Why a finished row could not be reported, if one could not.
    failed: Option<String>,
}

impl Collector {
    fn finish_row(&mut self, i: usize) {
        let reps: Vec<_> = self.got[i]
            .iter()
            .map(|r| r.as_ref().expect("complete"))
            .collect();
        let row = self.rows[i];
        let iters = reps.iter().map(|r| r.1.len()).min().unwrap_or(0);
        if iters == 0 {
            // No time to report: a table row of NaN would read as a measurement.
            self.failed.get_or_insert(format!(
                "row {i} ({} {} {} elements): a rank reported no timed iteration",
                row.algo.name(),
                row.dtype,
                row.count
            ));
            return;
        }
        // Per iteration the slowest rank's time, then the median and p99 over iterations.
        let mut per_iter: Vec<f64> = (0..iters)
            .map(|k| reps.iter().map(|r| r.1[k] as f64).fold(0.0, f64::max))
            .collect();
        per_iter.sort_by(f64::total_cmp);
        let pick = |q: f64| -> f64 { per_iter[((per_iter.len() - 1) as f64 * q).round() as usize] };
        let (med, p99) = (pick(0.5), pick(0.99));
        let bytes = row.count * row.dtype.size();
        let algbw = bytes as f64 / (med * 1e-6) / 1e9;
        let n = self.world as f64;
        let busbw = algbw * 2.0 * (n - 1.0) / n;
        let wrong = reps.iter().map(|r| r.2).sum();
        let graph = reps
            .iter()
            .map(|r| r.3.map(f64::from))
            .try_fold(0.0f64, |m, g| g.map(|g| m.max(g)));
        let out = RowOut {
            bytes,
            count: row.count,
            dtype: row.dtype.name(),
            algo: row.algo.name(),
            resolved: reps[0].0.name(),
            time_median_us: med,
            time_p99_us: p99,
            algbw_gbps: algbw,
            busbw_gbps: busbw,
            graph_us: graph,
            wrong,
        };
        if !self.json {
            let mut o = std::io::stdout().lock();
            if !self.printed_header {
                self.printed_header = true;
                let _ = writeln!(
                    o,
                    "{:>12} {:>12} {:>5} {:>13} {:>10} {:>10} {:>9} {:>9} {:>7} {:>10}",
                    "size(B)",
                    "count",
                    "type",
                    "algo",
                    "time(us)",
                    "p99(us)",
                    "algbw",
                    "busbw",
                    "#wrong",
                    "graph(us)"
                );
                let _ = writeln!(
                    o,
                    "{:>12} {:>12} {:>5} {:>13} {:>10} {:>10} {:>9} {:>9} {:>7} {:>10}",
                    "", "(elements)", "", "", "median", "", "(GB/s)", "(GB/s)", "", "replay"
                );
            }
            let algo = if row.algo == Algo::Auto {
                format!("auto:{}", out.resolved)
            } else {
                out.algo.to_string()
            };
            let _ = writeln!(
                o,
                "{:>12} {:>12} {:>5} {:>13} {:>10.2} {:>10.2} {:>9.3} {:>9.3} {:>7} {:>10}",
                out.bytes,
                out.count,
                out.dtype,
                algo,
                med,
                p99,
                algbw,
                busbw,
                wrong,
                graph.map_or("-".to_string(), |g| format!("{g:.2}"))
            );
        }
        self.out.push(out);
    }
}

impl Observer for Collector {
    fn report(&mut self, rank: usize, report: Report) {
        let Report::BenchRow {
            index,
            resolved,
            times_us,
            wrong,
            graph_us,
        } = report
        else {
            return;
        };
        let i = index as usize;
        if i >= self.got.len() {
            return;
        }
        self.got[i][rank] = Some((resolved, times_us, wrong, graph_us));
        if self.got[i].iter().all(Option::is_some) {
            self.finish_row(i);
        }
    }
}

/// CPU ranks share this host's memory: sizes it cannot hold are refused before any rank
/// starts, with the figures (the kernel's OOM killer met them mid-run otherwise, and the job
/// ended with "killed by SIGKILL"). Per rank: the communicator's exported buffer, the data
/// buffer, and the host copies of an input and, with --check, of the expected and read-back
/// results, each as large as the largest row.
fn fits_host_memory(spec: &BenchSpec, world: usize) -> Result<(), JobError> {
    let Some(available) = hostmem::available_bytes() else {
        return Ok(());
    };
    let max = spec.max_bytes() as u64;
    let comm = CommLayout::new(spec.max_bytes(), world).total_bytes() as u64;
    let copies = if spec.check { 4 } else { 2 };
    let need = world as u64 * (comm + copies * max);
    if need > available {
        let gib = hostmem::gib;
        return Err(JobError::Setup(anyhow::anyhow!(
            "{world} rank(s) at {:.2} GiB per call need about {:.1} GiB of host memory, and \
             {:.1} GiB are available (MemAvailable, or the cgroup's limit): smaller --sizes or \
             --counts, or fewer ranks",
            gib(max),
            gib(need),
            gib(available)
        )));
    }
    Ok(())
}

pub fn run(settings: &Settings, args: &BenchAllreduceArgs) -> Result<i32, JobError> {
    let rows = rows(args).map_err(|e| JobError::Usage(format!("{e:#}")))?;
    let world = settings.world;
    let spec = BenchSpec {
        rows: rows.clone(),
        check: args.check,
    };
    if settings.backend == Backend::Cpu {
        fits_host_memory(&spec, world)?;
    }
    let mut col = Collector {
        world,
        rows: rows.clone(),
        got: vec![vec![None; world]; rows.len()],
        out: Vec::new(),
        json: args.json,
        printed_header: false,
        failed: None,
    };
    if !args.json {
        println!(
            "# tprun bench allreduce: {} rank(s), backend {}, devices {:?}, in place, {}",
            world,
            settings.backend.name(),
            settings.devices,
            if args.check { "checked" } else { "unchecked" }
        );
    }
    crate::launch::run(settings.launch(Task::Bench(spec)), &mut col)?;
    if let Some(why) = col.failed {
        return Err(JobError::RankError(tprun_rank::FailKind::Internal, why));
    }
    let wrong: u64 = col.out.iter().map(|r| r.wrong).sum();
    let tuned = args.tune.then(|| tune(&col.out));
    if args.json {
        let v = serde_json::json!({
            "world": world,
            "backend": settings.backend.name(),
            "devices": settings.devices,
            "checked": args.check,
            "rows": col.out,
            "tune_oneshot_max_bytes": tuned,
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
    } else {
        let avg = col.out.iter().map(|r| r.busbw_gbps).sum::<f64>() / col.out.len().max(1) as f64;
        println!(
            "# Out of bounds values : {wrong} {}",
            if wrong == 0 { "OK" } else { "FAILED" }
        );
        println!("# Avg bus bandwidth    : {avg:.3} GB/s");
    }
    if let (Some(t), false) = (&tuned, args.json) {
        for (dtype, max) in t {
            let what = match max {
                Some(b) => format!("oneshot is faster up to {b} bytes, twoshot above"),
                None => "twoshot is faster from the smallest size".into(),
            };
            println!(
                "# tune {dtype}: {world} rank(s), {}: {what} (auto switches above {} bytes)",
                settings.backend.name(),
                tprun_rank::comm::auto_threshold(settings.backend, world)
            );
        }
    }
    if args.check && wrong > 0 {
        eprintln!("error: {wrong} element(s) differed from the reference");
        return Ok(1);
    }
    Ok(0)
}
