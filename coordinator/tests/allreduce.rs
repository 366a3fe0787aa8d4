//! The CPU allreduce through the real binary: real rank processes, real fd passing, every
//! algorithm and dtype, odd counts, `--check` comparing every element on every rank with the
//! exact rank-order sum (and the table's #wrong column must be 0 everywhere).

mod common;
use common::*;

fn check(world: usize, extra: &[&str]) {
    let env = Env::new(&format!("ar{world}"));
    let mut c = env.cmd();
    c.args([
        "--ranks",
        &world.to_string(),
        "--backend",
        "cpu",
        "bench",
        "allreduce",
    ])
    .args(["--algo", "all", "--dtype", "all", "--check", "--json"])
    .args(extra);
    let v = run_json(c, format!("world {world}"));
    let rows = v["rows"].as_array().unwrap();
    assert!(!rows.is_empty());
    for r in rows {
        assert_eq!(r["wrong"], 0, "world {world}: {r}");
    }
    // 4 algorithms × 3 dtypes × the sizes asked for.
    let sizes = extra
        .iter()
        .skip_while(|a| **a != "--counts" && **a != "--sizes")
        .nth(1)
        .unwrap()
        .split(',')
        .count();
    assert_eq!(rows.len(), 4 * 3 * sizes, "world {world}");
    env.assert_clean();
}

const SMALL: &[&str] = &[
    "--counts",
    "1,2,3,7,31,1001,4097,65537",
    "--iters",
    "3",
    "--warmup",
    "1",
];

#[test]
fn world_1() {
    check(1, SMALL);
}

#[test]
fn world_2() {
    check(2, SMALL);
}

#[test]
fn world_3() {
    check(3, SMALL);
}

#[test]
fn world_4() {
    check(4, SMALL);
}

#[test]
fn world_8() {
    check(8, SMALL);
}

#[test]
fn world_4_16mib() {
    check(4, &["--sizes", "16M", "--iters", "1", "--warmup", "1"]);
}

#[test]
fn world_3_odd_large() {
    // Odd element counts around 16 MiB: shards of unequal size, tails that are not a multiple
    // of any vector width.
    check(
        3,
        &[
            "--counts",
            "4194301,8388607",
            "--iters",
            "1",
            "--warmup",
            "1",
        ],
    );
}

#[test]
fn table_has_nccl_tests_columns() {
    let env = Env::new("table");
    let mut c = env.cmd();
    c.args([
        "--ranks",
        "2",
        "bench",
        "allreduce",
        "--sizes",
        "8:64",
        "--algo",
        "oneshot",
    ]);
    let out = stdout(&run_ok(c, "table"));
    for col in [
        "size(B)",
        "count",
        "type",
        "algo",
        "time(us)",
        "p99(us)",
        "algbw",
        "busbw",
        "#wrong",
        "graph(us)",
    ] {
        assert!(out.contains(col), "missing column {col}:\n{out}");
    }
    // 8, 16, 32, 64 bytes of f32; #wrong (9th column) is 0; no graph replay on the CPU ("-").
    let rows: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() == 10 && f[3] == "oneshot")
        .collect();
    assert_eq!(rows.len(), 4, "{out}");
    assert!(rows.iter().all(|f| f[8] == "0" && f[9] == "-"), "{out}");
    assert!(out.contains("Avg bus bandwidth"));
}

#[test]
fn tune_reports_a_crossover_per_dtype() {
    let env = Env::new("tune");
    let mut c = env.cmd();
    c.args([
        "--ranks",
        "2",
        "bench",
        "allreduce",
        "--tune",
        "--dtype",
        "f32,bf16",
    ])
    .args(["--sizes", "4K,64K", "--iters", "3", "--json"]);
    let v = run_json(c, "tune");
    // oneshot and twoshot only, each dtype, each size.
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2 * 2 * 2);
    assert!(rows
        .iter()
        .all(|r| r["algo"] == "oneshot" || r["algo"] == "twoshot"));
    let t = v["tune_oneshot_max_bytes"].as_object().unwrap();
    assert_eq!(t.len(), 2);
    for (_, max) in t {
        assert!(
            max.is_null() || [4096, 65536].contains(&max.as_u64().unwrap()),
            "{max}"
        );
    }
    env.assert_clean();
}
