//! `tprun bench gemv`: builds the rows, runs the job, and prints per row the time per call and
//! the bandwidth on the bytes the product must read (weights, and for int4 its scales, zeros
//! and perm), next to the device copy bandwidth measured in the same run (read + written per
//! second: the ceiling gemv.cu's table uses). With several ranks every rank runs the rows on
//! its own device; rank 0's figures are printed.

use anyhow::{anyhow, bail, Result};
use serde::Serialize;
use tprun_rank::job::{GemvBenchSpec, GemvQuant, GemvRow, Report, Task};

use crate::cli::BenchGemvArgs;
use crate::launch::{JobError, Observer};
use crate::Settings;

/// Most weight elements of one `--shapes` entry.
const MAX_ELEMENTS: usize = 1 << 32;

/// The rows of the job: one per `--shapes` entry, with the flags' weights.
pub fn rows(args: &BenchGemvArgs) -> Result<Vec<GemvRow>> {
    let mut rows = Vec::new();
    for s in &args.shapes {
        let (dims, silu, glu) = if let Some(d) = s.strip_suffix(":silu") {
            (d, true, false)
        } else if let Some(d) = s.strip_suffix(":glu") {
            (d, false, true)
        } else {
            (s.as_str(), false, false)
        };
        let parsed = dims
            .split_once('x')
            .and_then(|(n, k)| Some((n.parse::<usize>().ok()?, k.parse::<usize>().ok()?)));
        let Some((n, k)) = parsed.filter(|&(n, k)| n > 0 && k > 0 && n <= 1 << 24 && k <= 1 << 24)
        else {
            bail!("--shapes: '{s}' is not NxK[:silu|:glu] with N and K from 1 to 2^24");
        };
        if glu && !n.is_multiple_of(2) {
            bail!("--shapes: '{s}': :glu needs an even N (gate rows, then up rows)");
        }
        // The weights are drawn on the host (4 bytes per element while drawn): 2^32 elements
        // (16 GiB) is far past any model's matrix and still allocatable.
        if n * k > MAX_ELEMENTS {
            bail!("--shapes: '{s}' is {} elements, more than 2^32", n * k);
        }
        let quant = if args.quant == "int4" {
            let group = match args.group {
                -1 => k,
                g if g > 0 => g as usize,
                g => bail!("--group {g}: a positive size or -1"),
            };
            if !group.is_multiple_of(8) || !k.is_multiple_of(group) {
                bail!("--group {group} must be a multiple of 8 that divides K = {k} ('{s}')");
            }
            GemvQuant::Int4 {
                group,
                desc_act: args.desc_act,
            }
        } else {
            let dtype = crate::dtype_arg("--quant", &args.quant, &["int4"])
                .map_err(|e| anyhow!(e))?
                .expect("int4 handled above");
            GemvQuant::Dense(dtype)
        };
        rows.push(GemvRow {
            n,
            k,
            m: args.m,
            silu,
            glu,
            quant,
        });
    }
    Ok(rows)
}

#[derive(Serialize)]
struct RowOut {
    n: usize,
    k: usize,
    m: usize,
    prologue: &'static str,
    epilogue: &'static str,
    quant: String,
    bytes: u64,
    time_us: f64,
    tbps: f64,
    /// tbps over the copy bandwidth of the same run.
    of_copy: f64,
    /// Timed as graph replays rotating through copies of the weights (GPUs).
    graph: bool,
}

fn quant_name(q: GemvQuant) -> String {
    match q {
        GemvQuant::Dense(d) => d.name().to_string(),
        GemvQuant::Int4 { group, desc_act } => {
            format!("int4 g{group}{}", if desc_act { " act" } else { "" })
        }
    }
}

struct Collector {
    rows: Vec<GemvRow>,
    /// TB/s of the driver's copy and of the copy kernel.
    copies: Option<(f64, f64)>,
    out: Vec<RowOut>,
    json: bool,
}

/// TB/s of `bytes` moved in `us` microseconds.
fn tb_per_s(bytes: u64, us: f64) -> f64 {
    bytes as f64 / (us * 1e-6) / 1e12
}

impl Collector {
    /// The ceiling: the faster of the two copies.
    fn copy_tbps(&self) -> Option<f64> {
        self.copies.map(|(m, k)| m.max(k))
    }
}

impl Observer for Collector {
    fn report(&mut self, rank: usize, report: Report) {
        if rank != 0 {
            return;
        }
        match report {
            Report::CopyBandwidth {
                bytes,
                memcpy_us,
                kernel_us,
            } => {
                let (by_memcpy, by_kernel) =
                    (tb_per_s(bytes, memcpy_us), tb_per_s(bytes, kernel_us));
                self.copies = Some((by_memcpy, by_kernel));
                let tbps = self.copy_tbps().unwrap_or(f64::NAN);
                if !self.json {
                    println!(
                        "# device copy, {bytes} bytes read + written: {memcpy_us:.1} us by the \
                         driver's copy ({by_memcpy:.3} TB/s), {kernel_us:.1} us by a copy kernel \
                         ({by_kernel:.3} TB/s); 'of copy' is of the faster, {tbps:.3} TB/s"
                    );
                    println!(
                        "{:>8} {:>8} {:>5} {:>8} {:>14} {:>11} {:>10} {:>8} {:>8}",
                        "n", "k", "m", "act", "weights", "bytes", "time(us)", "TB/s", "of copy"
                    );
                }
            }
            Report::GemvRow {
                index,
                bytes,
                us,
                graph,
            } => {
                let Some(r) = self.rows.get(index as usize).copied() else {
                    return;
                };
                let tbps = tb_per_s(bytes, us);
                let out = RowOut {
                    n: r.n,
                    k: r.k,
                    m: r.m,
                    prologue: if r.silu { "silu_mul" } else { "none" },
                    epilogue: if r.glu { "silu_mul" } else { "none" },
                    quant: quant_name(r.quant),
                    bytes,
                    time_us: us,
                    tbps,
                    of_copy: self.copy_tbps().map_or(f64::NAN, |c| tbps / c),
                    graph,
                };
                if !self.json {
                    println!(
                        "{:>8} {:>8} {:>5} {:>8} {:>14} {:>11} {:>10.2} {:>8.4} {:>7.1}%",
                        out.n,
                        out.k,
                        out.m,
                        match (r.silu, r.glu) {
                            (true, _) => "silu>",
                            (_, true) => ">silu",
                            _ => "none",
                        },
                        out.quant,
                        out.bytes,
                        out.time_us,
                        out.tbps,
                        100.0 * out.of_copy
                    );
                }
                self.out.push(out);
            }
            _ => {}
        }
    }
}

pub fn run(settings: &Settings, args: &BenchGemvArgs) -> Result<i32, JobError> {
    let rows = rows(args).map_err(|e| JobError::Usage(format!("{e:#}")))?;
    let mut col = Collector {
        rows: rows.clone(),
        copies: None,
        out: Vec::new(),
        json: args.json,
    };
    if !args.json {
        println!(
            "# tprun bench gemv: {} rank(s), backend {}, devices {:?}; time per call (GPUs: \
             graph replays rotating through 1 GiB of weight copies)",
            settings.world,
            settings.backend.name(),
            settings.devices,
        );
    }
    let task = Task::BenchGemv(GemvBenchSpec {
        rows: rows.clone(),
        warmup: args.warmup,
        iters: args.iters,
    });
    crate::launch::run(settings.launch(task), &mut col)?;
    if col.out.len() != rows.len() {
        return Err(JobError::RankError(
            tprun_rank::FailKind::Internal,
            format!("{} of {} rows reported", col.out.len(), rows.len()),
        ));
    }
    if args.json {
        let v = serde_json::json!({
            "world": settings.world,
            "backend": settings.backend.name(),
            "devices": settings.devices,
            "copy_tbps": col.copy_tbps(),
            "copy_memcpy_tbps": col.copies.map(|c| c.0),
            "copy_kernel_tbps": col.copies.map(|c| c.1),
            "rows": col.out,
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use tprun_kernels::DType;

    fn args(line: &[&str]) -> BenchGemvArgs {
        let mut v = vec!["tprun", "bench", "gemv"];
        v.extend_from_slice(line);
        match crate::cli::Cli::try_parse_from(v).unwrap().command {
            crate::cli::Command::Bench {
                what: crate::cli::BenchCommand::Gemv(a),
            } => a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rows_follow_the_flags() {
        let r = rows(&args(&[])).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(
            (r[0].n, r[0].k, r[0].silu, r[0].glu),
            (34816, 5120, false, true)
        );
        assert_eq!(
            (r[1].n, r[1].k, r[1].silu, r[1].glu),
            (5120, 17408, false, false)
        );
        assert_eq!(
            r[1].quant,
            GemvQuant::Int4 {
                group: 128,
                desc_act: false
            }
        );
        let r = rows(&args(&["--quant", "bf16", "--shapes", "64x32:silu"])).unwrap();
        assert_eq!(r[0].quant, GemvQuant::Dense(DType::BF16));
        let r = rows(&args(&["--group", "-1", "--shapes", "8x200"])).unwrap();
        assert_eq!(
            r[0].quant,
            GemvQuant::Int4 {
                group: 200,
                desc_act: false
            }
        );
        for bad in [
            vec!["--shapes", "8x"],
            vec!["--group", "48", "--shapes", "8x64"],
            vec!["--quant", "int8"],
            vec!["--group", "0"],
            vec!["--shapes", "16777216x16777216"],
            vec!["--shapes", "7x64:glu"],
        ] {
            assert!(rows(&args(&bad)).is_err(), "{bad:?}");
        }
    }
}
