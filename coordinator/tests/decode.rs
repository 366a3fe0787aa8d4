//! `tprun decode` through the real binary: the trained stories260k model reproduces the
//! transformers reference at every world size, synthetic models of each architecture give the
//! same tokens at every world size, and bad input fails with one clear line.

mod common;
use common::*;

use std::path::{Path, PathBuf};

fn decode_json(env: &Env, world: usize, model: &Path, extra: &[&str]) -> serde_json::Value {
    let mut c = env.cmd();
    c.args([
        "--ranks",
        &world.to_string(),
        "--backend",
        "cpu",
        "decode",
        "--json",
    ])
    .arg("--model")
    .arg(model)
    .args(extra);
    run_json(c, format!("world {world}"))
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// The shared stories260k folder and its transformers reference, where the folder is there.
fn stories260k() -> Option<(PathBuf, serde_json::Value)> {
    let model = shared_model()?;
    let text = std::fs::read_to_string(model.join("reference.json")).unwrap();
    Some((model, serde_json::from_str(&text).unwrap()))
}

#[test]
fn stories260k_matches_the_transformers_reference_at_every_world_size() {
    let Some((model, reference)) = stories260k() else {
        println!("skipped: ../shared/models/stories260k not found");
        return;
    };
    let want = ids(&reference["generated_token_ids"]);
    // The reference stops 200 tokens past BOS (its "about" says so): the same budget here.
    let budget = want.len().to_string();
    let env = Env::new("stories");
    for world in [1, 2, 4, 8] {
        let v = decode_json(
            &env,
            world,
            &model,
            &[
                "--prompt",
                "Once upon a time",
                "--temperature",
                "0",
                "--max-new-tokens",
                &budget,
            ],
        );
        assert_eq!(ids(&v["prompt_ids"]), ids(&reference["prompt_token_ids"]));
        assert_eq!(ids(&v["token_ids"]), want, "world {world}");
        assert_eq!(
            format!(
                "{}{}",
                v["prompt"].as_str().unwrap(),
                v["text"].as_str().unwrap()
            ),
            reference["text"].as_str().unwrap(),
            "world {world}"
        );
    }
    env.assert_clean();
}

/// The text continues the prompt: with a prompt that stops before a word, the first
/// generated token's leading space is kept ("Once upon a" + " time", not "time"), in the
/// JSON and in the printed text.
#[test]
fn stories260k_text_continues_the_prompt() {
    let Some((model, reference)) = stories260k() else {
        println!("skipped: ../shared/models/stories260k not found");
        return;
    };
    let want = reference["text"].as_str().unwrap();
    let env = Env::new("stories-text");
    let args = [
        "--prompt",
        "Once upon a",
        "--temperature",
        "0",
        "--max-new-tokens",
        "6",
    ];
    let v = decode_json(&env, 1, &model, &args);
    let text = v["text"].as_str().unwrap();
    assert!(text.starts_with(" time,"), "{text:?}");
    assert!(want.starts_with(&format!("Once upon a{text}")), "{text:?}");
    let mut c = env.cmd();
    c.args(["--ranks", "1", "--backend", "cpu", "decode", "--model"])
        .arg(&model)
        .args(args);
    let out = c.output().unwrap();
    assert!(out.status.success());
    let printed = String::from_utf8(out.stdout).unwrap();
    assert_eq!(printed.trim_end(), format!("Once upon a{text}"));
    env.assert_clean();
}

fn synth(env: &Env, arch: &str, dtype: &str) -> PathBuf {
    let out = env.dir.join(format!("model-{arch}-{dtype}"));
    let mut c = env.cmd();
    c.args([
        "synth", "--arch", arch, "--preset", "tiny", "--dtype", dtype, "--seed", "5", "--out",
    ])
    .arg(&out);
    run_ok(c, "synth");
    out
}

#[test]
fn synthetic_models_give_the_same_tokens_at_every_world_size() {
    let env = Env::new("synth-worlds");
    for arch in ["llama", "qwen2", "qwen3"] {
        for dtype in ["f32", "bf16"] {
            let model = synth(&env, arch, dtype);
            let args = [
                "--temperature",
                "0",
                "--max-new-tokens",
                "24",
                "--ignore-eos",
                "--prompt",
                "Hello",
            ];
            let one = ids(&decode_json(&env, 1, &model, &args)["token_ids"]);
            assert_eq!(one.len(), 24);
            for world in [2, 3, 4] {
                let v = decode_json(&env, world, &model, &args);
                assert_eq!(ids(&v["token_ids"]), one, "{arch} {dtype} world {world}");
            }
            // Sampling with a seed is reproducible and identical across world sizes too. With
            // an f32 KV cache: world sizes differ in the last bits of the f32 sums, which a
            // bf16 cache can round to values a whole bf16 step apart, enough to move a
            // sampled draw across a boundary (greedy picks above have wide margins).
            let sargs = [
                "--kv-dtype",
                "f32",
                "--temperature",
                "1.0",
                "--seed",
                "7",
                "--max-new-tokens",
                "16",
                "--ignore-eos",
            ];
            let a = ids(&decode_json(&env, 1, &model, &sargs)["token_ids"]);
            let b = ids(&decode_json(&env, 3, &model, &sargs)["token_ids"]);
            assert_eq!(a, b, "{arch} {dtype} sampled");
            std::fs::remove_dir_all(&model).unwrap();
        }
    }
    env.assert_clean();
}

/// Qwen3.5 (`synth --arch qwen3_5`, the official multimodal layout) through the binary: rank
/// processes over the gated DeltaNet and gated-attention layers give the same greedy tokens
/// at 1, 2 and 4 ranks, and the same seeded samples at 1 and 4.
#[test]
fn qwen35_gives_the_same_tokens_at_every_world_size() {
    let env = Env::new("qwen35-worlds");
    let model = synth(&env, "qwen3_5", "f32");
    let args = [
        "--temperature",
        "0",
        "--max-new-tokens",
        "20",
        "--ignore-eos",
        "--prompt",
        "Hello",
    ];
    let one = ids(&decode_json(&env, 1, &model, &args)["token_ids"]);
    assert_eq!(one.len(), 20);
    for world in [2, 4] {
        let v = decode_json(&env, world, &model, &args);
        assert_eq!(ids(&v["token_ids"]), one, "qwen3_5 world {world}");
    }
    let sargs = [
        "--kv-dtype",
        "f32",
        "--temperature",
        "1.0",
        "--seed",
        "7",
        "--max-new-tokens",
        "16",
        "--ignore-eos",
    ];
    let a = ids(&decode_json(&env, 1, &model, &sargs)["token_ids"]);
    let b = ids(&decode_json(&env, 4, &model, &sargs)["token_ids"]);
    assert_eq!(a, b, "qwen3_5 sampled");
    std::fs::remove_dir_all(&model).unwrap();
    env.assert_clean();
}

/// `synth --arch qwen3_5 --quant gptq-int4` (the MLP in GPTQ int4, the official layout)
/// through the binary, with and without `--desc-act`: the same greedy tokens at 1 and 2
/// ranks (2 ranks split the MLP in whole groups).
#[test]
fn qwen35_gptq_synth_gives_the_same_tokens_at_one_and_two_ranks() {
    let env = Env::new("qwen35-gptq");
    for extra in [&[][..], &["--desc-act"][..]] {
        let model = env.dir.join("model-qwen35-gptq");
        let mut c = env.cmd();
        c.args([
            "synth",
            "--arch",
            "qwen3_5",
            "--preset",
            "tiny",
            "--quant",
            "gptq-int4",
            "--seed",
            "5",
        ])
        .args(extra)
        .arg("--out")
        .arg(&model);
        run_ok(c, "synth --quant gptq-int4");
        let args = [
            "--temperature",
            "0",
            "--max-new-tokens",
            "16",
            "--ignore-eos",
            "--prompt",
            "Hello",
        ];
        let one = decode_json(&env, 1, &model, &args);
        assert_eq!(ids(&one["token_ids"]).len(), 16);
        let two = decode_json(&env, 2, &model, &args);
        assert_eq!(ids(&two["token_ids"]), ids(&one["token_ids"]), "{extra:?}");
        std::fs::remove_dir_all(&model).unwrap();
    }
    env.assert_clean();
}

/// `--dump-logits`: one full-vocab f32 row per generated token, the row's argmax being the
/// token (greedy), identical across world sizes to the last bits of the sums; and the step
/// replayed as a graph where there are none (CPU) runs the ops one by one, same tokens.
#[test]
fn dump_logits_writes_a_row_per_token_and_graph_mode_agrees() {
    let env = Env::new("dump");
    let model = synth(&env, "qwen3", "f32");
    let mut rows = Vec::new();
    for world in [1usize, 2] {
        // Six greedy tokens, with the flags under test.
        let greedy6 = |flags: &[&str]| {
            let base = [
                "--temperature",
                "0",
                "--max-new-tokens",
                "6",
                "--ignore-eos",
            ];
            decode_json(&env, world, &model, &[&base[..], flags].concat())
        };
        let f = env.dir.join(format!("logits-{world}.f32"));
        let v = greedy6(&["--dump-logits", f.to_str().unwrap()]);
        let toks = ids(&v["token_ids"]);
        let bytes = std::fs::read(&f).unwrap();
        let vals: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(vals.len() % toks.len(), 0);
        let vocab = vals.len() / toks.len();
        for (row, &t) in vals.chunks_exact(vocab).zip(&toks) {
            let best = row
                .iter()
                .enumerate()
                .fold(0, |b, (i, &x)| if x > row[b] { i } else { b });
            assert_eq!(best as u64, t, "world {world}");
        }
        rows.push(vals);
        let g = greedy6(&["--graph", "on"]);
        assert_eq!(ids(&g["token_ids"]), toks, "graph on, world {world}");
        assert_eq!(g["graph"], false, "no graphs on the cpu backend");
        let prof = greedy6(&["--profile"]);
        assert_eq!(ids(&prof["token_ids"]), toks, "--profile, world {world}");
        assert_eq!(
            prof["profile"],
            serde_json::json!([]),
            "the cpu backend times no ops"
        );
    }
    let diff = rows[0]
        .iter()
        .zip(&rows[1])
        .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
        .fold(0f32, f32::max);
    assert!(diff < 1e-5, "world 1 vs 2: {diff}");
    std::fs::remove_dir_all(&model).unwrap();
    for d in std::fs::read_dir(&env.dir).unwrap() {
        let p = d.unwrap().path();
        if p.is_dir() {
            std::fs::remove_dir_all(p).unwrap();
        } else {
            std::fs::remove_file(p).unwrap();
        }
    }
    env.assert_clean();
}

#[test]
fn default_model_streams_text_and_a_summary() {
    let env = Env::new("default");
    let mut c = env.cmd();
    c.args([
        "--ranks",
        "4",
        "decode",
        "--max-new-tokens",
        "20",
        "--ignore-eos",
    ]);
    let o = run_ok(c, "default model");
    assert!(stdout(&o).starts_with("Once upon a time"));
    let err = stderr(&o);
    for part in ["load", "prefill", "tok/s", "decode 20 tokens", "p50", "p99"] {
        assert!(err.contains(part), "summary lacks {part}: {err}");
    }
    env.assert_clean();
}

/// Rewrites the JSON header of a safetensors file in place, keeping its length (padding with
/// spaces, which the format allows), so that data offsets stay valid.
fn edit_header(path: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    h.remove("__metadata__");
    f(&mut h);
    let mut new = serde_json::to_vec(&h).unwrap();
    assert!(new.len() <= n, "edited header grew");
    new.resize(n, b' ');
    bytes[8..8 + n].copy_from_slice(&new);
    std::fs::write(path, bytes).unwrap();
}

fn expect_error(env: &Env, model: &Path, world: usize, extra: &[&str], needle: &str) {
    let mut c = env.cmd();
    c.args([
        "--ranks",
        &world.to_string(),
        "decode",
        "--max-new-tokens",
        "4",
        "--model",
    ])
    .arg(model)
    .args(extra);
    let o = run(c);
    let err = stderr(&o);
    assert!(!o.status.success(), "{needle}: succeeded");
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(lines.len(), 1, "one error line expected: {err}");
    assert!(
        lines[0].contains(needle),
        "expected '{needle}' in: {}",
        lines[0]
    );
}

#[test]
fn bad_input_fails_with_one_clear_line() {
    let env = Env::new("bad");
    let good = synth(&env, "llama", "f32");
    let fresh = |name: &str| {
        let d = env.dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        for e in std::fs::read_dir(&good).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
        }
        d
    };

    let d = fresh("no-config");
    std::fs::remove_file(d.join("config.json")).unwrap();
    expect_error(&env, &d, 2, &[], "config.json");

    let d = fresh("bad-config");
    std::fs::write(d.join("config.json"), "{ \"hidden_size\": 64,").unwrap();
    expect_error(&env, &d, 2, &[], "config.json");

    let d = fresh("unsupported");
    let cfg = std::fs::read_to_string(d.join("config.json")).unwrap();
    std::fs::write(
        d.join("config.json"),
        cfg.replace("LlamaForCausalLM", "GPT2LMHeadModel"),
    )
    .unwrap();
    expect_error(&env, &d, 2, &[], "GPT2LMHeadModel");

    let d = fresh("truncated");
    let st = d.join("model.safetensors");
    let len = std::fs::metadata(&st).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&st)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    expect_error(&env, &d, 2, &[], "model.safetensors");

    let d = fresh("corrupt");
    let st = d.join("model.safetensors");
    let mut b = std::fs::read(&st).unwrap();
    b[8..24].copy_from_slice(b"\xff\xfe garbage! \x00\x01\x02\x03");
    std::fs::write(&st, b).unwrap();
    expect_error(&env, &d, 2, &[], "model.safetensors");

    let d = fresh("missing-tensor");
    edit_header(&d.join("model.safetensors"), |h| {
        let v = h.remove("model.norm.weight").unwrap();
        h.insert("model.norX.weight".into(), v);
    });
    expect_error(&env, &d, 2, &[], "model.norm.weight");

    let d = fresh("wrong-shape");
    edit_header(&d.join("model.safetensors"), |h| {
        // Same number of elements, another shape.
        let t = h.get_mut("model.layers.0.self_attn.q_proj.weight").unwrap();
        t["shape"] = serde_json::json!([32, 128]);
    });
    expect_error(&env, &d, 2, &[], "q_proj");

    let d = fresh("wrong-dtype");
    edit_header(&d.join("model.safetensors"), |h| {
        let t = h.get_mut("model.layers.1.mlp.down_proj.weight").unwrap();
        t["dtype"] = serde_json::json!("I32");
    });
    expect_error(&env, &d, 2, &[], "down_proj");

    let d = fresh("no-tokenizer");
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    expect_error(&env, &d, 2, &[], "tokenizer.json");

    let long = "x".repeat(10_000);
    expect_error(&env, &good, 2, &["--prompt", &long], "context");

    // 8 query heads over 4 KV heads cannot be shared out among 6 ranks.
    expect_error(&env, &good, 6, &[], "head");

    let missing = env.dir.join("does-not-exist");
    expect_error(&env, &missing, 1, &[], "does-not-exist");

    // The decode flags' own bounds, each named where it enters.
    expect_error(&env, &good, 1, &["--kv-dtype", "u32"], "--kv-dtype");
    expect_error(&env, &good, 1, &["--top-k", "65"], "--top-k");
    expect_error(&env, &good, 1, &["--max-seq", "0"], "--max-seq");
    // A KV cache that does not fit: one line with the memory it needs, nothing left behind.
    expect_error(&env, &good, 2, &["--max-seq", "5000000000"], "--max-seq");
    expect_error(
        &env,
        &good,
        1,
        &["--max-seq", "2000000000"],
        "GiB of host memory",
    );

    for d in std::fs::read_dir(&env.dir).unwrap() {
        std::fs::remove_dir_all(d.unwrap().path()).unwrap();
    }
    env.assert_clean();
}
