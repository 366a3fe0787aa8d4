//! `tprun info` and `tprun selftest`: what the machine offers, and whether every kernel and
//! every allreduce algorithm computes the right bits on it. The checks run in rank processes
//! (a one-rank job for the kernels, a `--ranks` job for the allreduce); this only prints.

use serde_json::json;
use tprun_kernels::cuda;
use tprun_kernels::cuda::SelftestResult;
use tprun_rank::job::{Algo, Backend, BenchRow, BenchSpec, Report, SelftestSpec, Task};

use crate::cli::{InfoArgs, SelftestArgs};
use crate::launch::{JobError, Observer};
use crate::Settings;

pub fn info(args: &InfoArgs) -> Result<i32, JobError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cuda = cuda::probe();
    let nvrtc = cuda::nvrtc_present();
    let peers = match &cuda {
        Ok(d) if !d.is_empty() => cuda::peer_matrix().ok(),
        _ => None,
    };
    // HIP: the devices and peer pairs through the same probe over the HIP table.
    let hip = cuda::Gpu::Hip.driver().and_then(|d| {
        let devs = cuda::probe::probe_with(&*d)?;
        let peers = cuda::probe::peer_matrix_with(&*d).ok();
        Ok((devs, peers))
    });
    if args.json {
        let v = json!({
            "cpu": { "cores": cores, "arch": std::env::consts::ARCH },
            "cuda": match &cuda {
                Ok(devs) => json!({
                    "available": true,
                    "nvrtc": nvrtc,
                    "devices": devs,
                    "peer_access": peers,
                }),
                Err(e) => json!({ "available": false, "why": e.to_string() }),
            },
            "hip": match &hip {
                Ok((devs, peers)) => json!({
                    "available": true,
                    "devices": devs,
                    "peer_access": peers,
                }),
                Err(e) => json!({ "available": false, "why": crate::unusable_why(e) }),
            },
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
        return Ok(0);
    }
    println!(
        "cpu   available: {cores} core(s), {}",
        std::env::consts::ARCH
    );
    match &cuda {
        Ok(devs) => {
            println!(
                "cuda  available: {} device(s); NVRTC {}",
                devs.len(),
                if nvrtc {
                    "found"
                } else {
                    "NOT found (kernels cannot be compiled)"
                }
            );
            print_devices(devs);
            if let Some(m) = peers {
                print_peers(&m);
            }
        }
        Err(e) => println!("cuda  unavailable: {e}"),
    }
    match &hip {
        Ok((devs, peers)) => {
            println!("hip   available: {} device(s)", devs.len());
            // (On HIP, `uuid` ends with the PCI bus id in parentheses.)
            print_devices(devs);
            if let Some(m) = peers {
                print_peers(m);
            }
        }
        Err(e) => println!("hip   unavailable: {}", crate::unusable_why(e)),
    }
    Ok(0)
}

/// One line per device: ordinal, name, memory, architecture, UUID.
fn print_devices(devs: &[tprun_kernels::DeviceInfo]) {
    for d in devs {
        println!(
            "  [{}] {}  {:.1} GiB  {}  {}",
            d.ordinal,
            d.name,
            d.memory as f64 / (1u64 << 30) as f64,
            d.arch,
            d.uuid
        );
    }
}

/// The peer-access matrix: a Y where the row's device maps the column's memory.
fn print_peers(m: &[Vec<bool>]) {
    println!("  peer access (row maps column's memory):");
    print!("      ");
    for j in 0..m.len() {
        print!("{j:>3}");
    }
    println!();
    for (i, row) in m.iter().enumerate() {
        print!("  {i:>3} ");
        for &ok in row {
            print!("{:>3}", if ok { "Y" } else { "." });
        }
        println!();
    }
}

struct Wrong {
    rows: Vec<BenchRow>,
    wrong: Vec<u64>,
    seen: Vec<usize>,
}

impl Observer for Wrong {
    fn report(&mut self, _rank: usize, r: Report) {
        if let Report::BenchRow { index, wrong, .. } = r {
            let i = index as usize;
            if i < self.rows.len() {
                self.wrong[i] += wrong;
                self.seen[i] += 1;
            }
        }
    }
}

/// The kernel checks' report from the one rank that ran them.
#[derive(Default)]
struct Kernels {
    checks: Option<u64>,
    failed: Vec<SelftestResult>,
}

impl Observer for Kernels {
    fn report(&mut self, _rank: usize, r: Report) {
        if let Report::Selftest { checks, failed } = r {
            self.checks = Some(checks);
            self.failed = failed;
        }
    }
}

pub fn selftest(settings: &Settings, args: &SelftestArgs) -> Result<i32, JobError> {
    let mut failed = 0usize;
    // 1. Kernels against their CPU twins (GPU backends), in one rank on the first device
    //    (inside it, "ranks" as threads on that device).
    if settings.backend != Backend::Cpu {
        let device = settings.devices[0];
        let mut kernels = Kernels::default();
        let task = Task::Selftest(SelftestSpec { seed: args.seed });
        crate::launch::run(settings.launch_on(vec![device], task), &mut kernels)?;
        let Some(checks) = kernels.checks else {
            return Err(JobError::Setup(anyhow::anyhow!(
                "the selftest rank finished without reporting its checks"
            )));
        };
        let bad = &kernels.failed;
        println!(
            "kernels   {} device {device}: {checks} check(s), {} failed",
            settings.backend.name(),
            bad.len()
        );
        for r in bad {
            println!(
                "  FAILED {} {} {} elements: {}",
                r.op, r.dtype, r.elems, r.detail
            );
        }
        failed += bad.len();
    } else {
        println!(
            "kernels   cpu: the CPU ops are the reference (their tests compare them with f64)"
        );
    }
    // 2. Every algorithm and dtype through real rank processes, odd counts included.
    let world = settings.world;
    let mut rows = Vec::new();
    for dtype in tprun_kernels::DType::ALL {
        for algo in Algo::ALL {
            for count in [1usize, 7, 1000, 65_537, 1 << 20] {
                rows.push(BenchRow {
                    algo,
                    dtype,
                    count,
                    warmup: 1,
                    iters: 2,
                });
            }
        }
    }
    let mut obs = Wrong {
        wrong: vec![0; rows.len()],
        seen: vec![0; rows.len()],
        rows: rows.clone(),
    };
    let spec = BenchSpec { rows, check: true };
    crate::launch::run(settings.launch(Task::Bench(spec)), &mut obs)?;
    let mut bad_rows = 0;
    for (i, r) in obs.rows.iter().enumerate() {
        if obs.wrong[i] > 0 || obs.seen[i] != world {
            bad_rows += 1;
            println!(
                "  FAILED allreduce {} {} {} elements: {} wrong element(s)",
                r.algo.name(),
                r.dtype,
                r.count,
                obs.wrong[i]
            );
        }
    }
    println!(
        "allreduce {} rank(s) on {} {:?}: {} case(s), {} failed",
        world,
        settings.backend.name(),
        settings.devices,
        obs.rows.len(),
        bad_rows
    );
    failed += bad_rows;
    if failed > 0 {
        eprintln!("error: selftest: {failed} check(s) failed");
        return Ok(1);
    }
    println!("selftest passed");
    Ok(0)
}
