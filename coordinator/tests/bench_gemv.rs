//! `bench gemv` through the real binary on the CPU backend: the smoke test CI runs (the GPU
//! figures come from `tprun bench gemv` on a GPU machine).

mod common;
use common::*;

fn rows(extra: &[&str]) -> Vec<serde_json::Value> {
    let env = Env::new("gemv");
    let mut c = env.cmd();
    c.args([
        "--backend",
        "cpu",
        "bench",
        "gemv",
        "--json",
        "--iters",
        "1",
    ])
    .args(["--warmup", "0"])
    .args(extra);
    let v = run_json(c, format!("bench gemv {extra:?}"));
    // The ceiling is the faster of the driver's copy and the copy kernel.
    let (copy, by_memcpy, by_kernel) = (
        v["copy_tbps"].as_f64().unwrap(),
        v["copy_memcpy_tbps"].as_f64().unwrap(),
        v["copy_kernel_tbps"].as_f64().unwrap(),
    );
    assert!(by_memcpy > 0.0 && by_kernel > 0.0, "{v}");
    assert_eq!(copy, by_memcpy.max(by_kernel), "{v}");
    let rows = v["rows"].as_array().unwrap().clone();
    for r in &rows {
        assert!(r["time_us"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["tbps"].as_f64().unwrap() > 0.0, "{r}");
    }
    env.assert_clean();
    rows
}

#[test]
fn int4_and_dense_rows_run_on_the_cpu() {
    let r = rows(&["--shapes", "64x256,32x512:silu,64x256:glu"]);
    assert_eq!(r.len(), 3);
    assert_eq!(r[2]["epilogue"], "silu_mul");
    // int4 at group 128: n·k/2 bytes of nibbles, 2 per scale, 4 per zeros word of 8 groups.
    assert_eq!(r[0]["bytes"], 64 * 256 / 2 + 64 * 2 * 2 + 64 * 4);
    assert_eq!(r[1]["prologue"], "silu_mul");
    let r = rows(&[
        "--shapes",
        "64x256",
        "--group",
        "32",
        "--desc-act",
        "--m",
        "3",
    ]);
    assert_eq!(r[0]["quant"], "int4 g32 act");
    let r = rows(&["--shapes", "64x256", "--quant", "bf16"]);
    assert_eq!(r[0]["bytes"], 64 * 256 * 2);
}
