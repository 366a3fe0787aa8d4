//! Bad input through the real binary, one table row per case: every flag's range, every
//! config.json field that sizes something, broken model folders, non-finite weights. Each case
//! must end with its exit code (2 usage, 1 error, 3 a rank failed) and exactly one line
//! starting `error:` that names the culprit, with no panic text, and leave nothing in its own
//! `$TMPDIR` / `$XDG_RUNTIME_DIR` or in `/dev/shm`.
//!
//! Models are tiny synthetic ones, written once per test binary under cargo's target tmp
//! folder; each variant (an edited config, a poisoned tensor) is a copy of one of them. Cases
//! that die by signal or stall (leftovers after SIGKILL, stall exit codes) are tested
//! elsewhere.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde_json::{json, Value};

/// One bad input and what it must give.
struct Case {
    /// Arguments after the binary's name.
    args: Vec<String>,
    /// Extra environment.
    env: Vec<(&'static str, String)>,
    /// Expected exit code.
    code: i32,
    /// The error line must contain this (the flag, field or file at fault).
    culprit: &'static str,
}

fn case(args: &[&str], code: i32, culprit: &'static str) -> Case {
    Case {
        args: args.iter().map(|s| s.to_string()).collect(),
        env: vec![],
        code,
        culprit,
    }
}

/// `tprun --backend cpu decode --model DIR <extra>`.
fn decode(model: &Path, extra: &[&str], code: i32, culprit: &'static str) -> Case {
    let mut c = case(&["--backend", "cpu", "decode", "--model"], code, culprit);
    c.args.push(model.to_str().unwrap().to_string());
    c.args.extend(extra.iter().map(|s| s.to_string()));
    c
}

/// `tprun --backend cpu serve --port 0 <extra>`.
fn serve(extra: &[&str], code: i32, culprit: &'static str) -> Case {
    let mut c = case(&["--backend", "cpu", "serve", "--port", "0"], code, culprit);
    c.args.extend(extra.iter().map(|s| s.to_string()));
    c
}

/// Names in /dev/shm that look like ours (tprun keeps shared memory in memfds, never there).
fn shm_names() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.to_lowercase().contains("tprun"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Runs one case in a fresh runtime folder and checks everything the module's header says;
/// returns the error line and the whole of stderr.
fn check(c: &Case) -> (String, String) {
    let what = c.args.join(" ");
    let env = Env::new("bad");
    let shm_before = shm_names();
    let mut cmd = env.cmd();
    cmd.args(&c.args).env("RUST_BACKTRACE", "1");
    for (k, v) in &c.env {
        cmd.env(k, v);
    }
    let o = run(cmd);
    let (out, err) = (stdout(&o), stderr(&o));
    for text in [&out, &err] {
        for bad in ["panicked", "RUST_BACKTRACE", "stack backtrace"] {
            assert!(
                !text.contains(bad),
                "{what}: '{bad}' in the output:\n{err}\n{out}"
            );
        }
    }
    assert_eq!(o.status.code(), Some(c.code), "{what}: exit status\n{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "{what}: one error line expected:\n{err}");
    assert!(
        lines[0].contains(c.culprit),
        "{what}: the error line does not name '{}': {}",
        c.culprit,
        lines[0]
    );
    env.assert_clean();
    assert_eq!(shm_names(), shm_before, "{what}: /dev/shm changed");
    (lines[0].to_string(), err)
}

fn check_all(cases: &[Case]) {
    for c in cases {
        check(c);
    }
}

// ---- fixtures ---------------------------------------------------------------------------------

/// The base models every variant is copied from, written once per test binary.
struct Fixtures {
    dir: PathBuf,
    /// Llama, tiny, f32 (tied embeddings).
    llama: PathBuf,
    /// Qwen3, tiny, f32 (an LM head of its own).
    qwen3: PathBuf,
}

fn fixtures() -> &'static Fixtures {
    static F: OnceLock<Fixtures> = OnceLock::new();
    F.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bad_input");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let synth = |arch: &str| {
            let out = dir.join(format!("base-{arch}"));
            let mut c = Command::new(env!("CARGO_BIN_EXE_tprun"));
            c.args([
                "synth", "--arch", arch, "--dtype", "f32", "--seed", "3", "--out",
            ])
            .arg(&out);
            run_ok(c, format!("synth {arch}"));
            out
        };
        Fixtures {
            llama: synth("llama"),
            qwen3: synth("qwen3"),
            dir,
        }
    })
}

/// A copy of `base` named `name`, for one variant.
fn variant(base: &Path, name: &str) -> PathBuf {
    let d = fixtures().dir.join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(base).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
    }
    d
}

/// A copy of the llama model whose model.safetensors is a FIFO.
fn fifo_model() -> PathBuf {
    let d = variant(&fixtures().llama, "fifo");
    let p = d.join("model.safetensors");
    std::fs::remove_file(&p).unwrap();
    nix::unistd::mkfifo(&p, nix::sys::stat::Mode::S_IRWXU).unwrap();
    d
}

/// A copy of the llama model whose config.json has `field` set to `value` (null removes it).
fn config_with(name: &str, field: &str, value: Value) -> PathBuf {
    let d = variant(&fixtures().llama, name);
    let p = d.join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    if value.is_null() {
        cfg.as_object_mut().unwrap().remove(field);
    } else {
        cfg[field] = value;
    }
    std::fs::write(&p, cfg.to_string()).unwrap();
    d
}

/// Overwrites element `index` of f32 tensor `name` in `dir/model.safetensors` with `value`.
fn poison(dir: &Path, name: &str, index: usize, value: f32) {
    let p = dir.join("model.safetensors");
    let mut b = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let t = &header[name];
    assert_eq!(t["dtype"], "F32", "{name}");
    let start = t["data_offsets"][0].as_u64().unwrap() as usize;
    let at = 8 + n + start + 4 * index;
    b[at..at + 4].copy_from_slice(&value.to_le_bytes());
    std::fs::write(&p, b).unwrap();
}

// ---- the cases --------------------------------------------------------------------------------

/// Global flags: out-of-range numbers (the float → Duration panic and the millisecond
/// wrap of a huge --timeout among them), negative values, flags a command would ignore.
#[test]
fn global_flags() {
    let bench = |pre: &[&str], culprit| {
        let mut a = pre.to_vec();
        a.extend(["bench", "allreduce", "--counts", "8", "--iters", "1"]);
        case(&a, 2, culprit)
    };
    let sixty_five = vec!["0"; 65].join(",");
    let mut cases = vec![
        bench(&["--timeout", "1e20"], "--timeout"),
        bench(&["--timeout", "18446744073709552"], "--timeout"),
        bench(&["--timeout", "86401"], "--timeout"),
        bench(&["--timeout", "0"], "--timeout"),
        bench(&["--timeout", "0.0001"], "--timeout"),
        bench(&["--timeout", "-5"], "--timeout"),
        bench(&["--timeout", "nan"], "--timeout"),
        bench(&["--timeout", "inf"], "--timeout"),
        bench(&["--timeout", "soon"], "--timeout"),
        bench(&["--ranks", "0"], "--ranks"),
        bench(&["--ranks", "65"], "--ranks"),
        bench(&["--ranks", "-1"], "--ranks"),
        bench(&["--ranks", "99999999999999999999999"], "--ranks"),
        bench(&["--ranks", "2.5"], "--ranks"),
        bench(&["--devices", "0,1", "--ranks", "3"], "--devices"),
        bench(&["--devices", "-1"], "--devices"),
        bench(&["--devices", "0,,1"], "--devices"),
        bench(&["--devices", "gpu0"], "--devices"),
        bench(&["--devices", "5000"], "--devices"),
        bench(&["--devices", &sixty_five], "--devices"),
        bench(&["--backend", "tpu"], "--backend"),
        // No HIP device here (or no runtime): one line naming it, exit 1.
        case(
            &["--backend", "hip", "bench", "allreduce", "--counts", "8"],
            1,
            "hip",
        ),
        case(&["--backend", "hip", "selftest"], 1, "hip"),
        case(&["--backend", "hip", "info"], 1, "hip"),
        case(&["info", "--backend", "hip", "--json"], 1, "hip"),
        bench(&["--ipc", "carrier-pigeon"], "--ipc"),
        case(&["--bogus-flag", "decode"], 2, "--bogus-flag"),
        case(&["frobnicate"], 2, "frobnicate"),
        // Flags of a job given to commands that start none.
        case(&["--ranks", "0", "synth", "--out", "x"], 2, "--ranks"),
        case(&["--ranks", "2", "synth", "--out", "x"], 2, "--ranks"),
        case(&["synth", "--backend", "cpu", "--out", "x"], 2, "--backend"),
        case(&["--timeout", "5", "info"], 2, "--timeout"),
        case(&["--devices", "0", "info", "--json"], 2, "--devices"),
        case(
            &["rank", "--join", "x", "--rank", "0", "--ipc", "fd"],
            2,
            "--ipc",
        ),
        // The rank's own flags and token (before it connects anywhere).
        case(&["rank", "--join", "x", "--rank", "64"], 2, "--rank"),
        case(&["rank", "--join", "x", "--rank", "-1"], 2, "--rank"),
        case(
            &[
                "rank",
                "--join",
                "x",
                "--rank",
                "0",
                "--token-file",
                "/nonexistent/token",
            ],
            2,
            "token file",
        ),
    ];
    let mut c = case(&["rank", "--join", "x", "--rank", "0"], 2, "job token");
    c.env.push(("TPRUN_JOB_TOKEN", "not-hex".into()));
    cases.push(c);
    let mut c = bench(&["--backend", "cpu"], "TPRUN_CUDA_COMM_BLOCKS");
    c.env.push(("TPRUN_CUDA_COMM_BLOCKS", "0".into()));
    cases.push(c);
    check_all(&cases);
}

/// `bench allreduce`: counts and sizes that overflowed count × size, warm-up and iterations
/// that wrapped into an all-NaN table, bad names.
#[test]
fn bench_flags() {
    let b = |extra: &[&str], culprit| {
        let mut a = vec!["--backend", "cpu", "bench", "allreduce"];
        a.extend(extra);
        case(&a, 2, culprit)
    };
    check_all(&[
        b(
            &["--counts", "4611686018427387904", "--algo", "host"],
            "--counts",
        ),
        b(&["--counts", "4294967297"], "--counts"),
        b(&["--counts", "0"], "--counts"),
        b(&["--counts", "-1"], "--counts"),
        b(&["--counts", "8,x"], "--counts"),
        b(&["--warmup", "4294967295", "--iters", "1"], "--warmup"),
        b(&["--warmup", "-1"], "--warmup"),
        b(&["--iters", "0"], "--iters"),
        b(&["--iters", "100000001"], "--iters"),
        b(&["--iters", "-3"], "--iters"),
        b(&["--sizes", "0"], "--sizes"),
        b(&["--sizes", "64:8"], "--sizes"),
        b(&["--sizes", "1:32G"], "--sizes"),
        b(&["--sizes", "99999999999999999999G"], "--sizes"),
        b(&["--sizes", "4X"], "--sizes"),
        b(&["--sizes", "8,,16"], "--sizes"),
        b(&["--sizes", "2", "--dtype", "f32"], "--sizes"),
        b(&["--algo", "fastest"], "--algo"),
        b(&["--dtype", "int8"], "--dtype"),
        b(&["--dtype", "u32"], "--dtype"),
        b(&["--tune", "--algo", "host"], "--tune"),
        b(&["--counts", "8", "--sizes", "8"], "--counts"),
    ]);
    // More host memory than any machine has (64 ranks at 16 GiB: ~4 TiB; CPU ranks share the
    // host's): refused
    // before a rank starts, with the figures, not met by the OOM killer.
    check_all(&[case(
        &[
            "--backend",
            "cpu",
            "--ranks",
            "64",
            "bench",
            "allreduce",
            "--sizes",
            "16G",
        ],
        1,
        "host memory",
    )]);
}

/// `decode`'s flags, each refused where it is parsed (negative values included), and missing
/// files.
#[test]
fn decode_flags() {
    let m = &fixtures().llama;
    check_all(&[
        decode(m, &["--temperature", "-1"], 2, "--temperature"),
        decode(m, &["--temperature", "nan"], 2, "--temperature"),
        decode(m, &["--temperature", "inf"], 2, "--temperature"),
        decode(m, &["--temperature", "1e39"], 2, "--temperature"),
        decode(m, &["--top-p", "0"], 2, "--top-p"),
        decode(m, &["--top-p", "1.5"], 2, "--top-p"),
        decode(m, &["--top-p", "-0.5"], 2, "--top-p"),
        decode(m, &["--top-k", "65"], 2, "--top-k"),
        decode(m, &["--top-k", "-1"], 2, "--top-k"),
        decode(m, &["--max-seq", "0"], 2, "--max-seq"),
        decode(m, &["--max-seq", "4294967295"], 2, "--max-seq"),
        decode(m, &["--max-new-tokens", "-1"], 2, "--max-new-tokens"),
        decode(m, &["--max-new-tokens", "1e5"], 2, "--max-new-tokens"),
        decode(m, &["--seed", "-1"], 2, "--seed"),
        decode(m, &["--dtype", "f64"], 2, "--dtype"),
        decode(m, &["--kv-dtype", "u32"], 2, "--kv-dtype"),
        decode(m, &["--graph", "maybe"], 2, "--graph"),
        decode(m, &["--prompt", "x", "--prompt-file", "y"], 2, "--prompt"),
        decode(
            m,
            &["--prompt-file", "/nonexistent/prompt.txt"],
            1,
            "/nonexistent/prompt.txt",
        ),
        decode(
            Path::new("/nonexistent/model"),
            &[],
            1,
            "/nonexistent/model",
        ),
        // An endless prompt file stops at the bound; a FIFO in place of the checkpoint is
        // refused before it is opened (opening it waited for a writer for ever).
        decode(m, &["--prompt-file", "/dev/zero"], 1, "larger than"),
        decode(&fifo_model(), &[], 1, "not a regular file"),
        // serve --listen: a path that exists (a file, not ours to remove) or a bad token.
        serve(&["--listen", "/etc/hostname"], 1, "/etc/hostname"),
        Case {
            env: vec![("TPRUN_JOB_TOKEN", "xyz".into())],
            ..serve(&["--listen", "/nonexistent/s"], 2, "TPRUN_JOB_TOKEN")
        },
        // A CPU server whose ranks' KV caches cannot fit in this host's memory: refused
        // before it listens, with the figures.
        serve(
            &["--model", m.to_str().unwrap(), "--max-seq", "2000000000"],
            1,
            "GiB of host memory",
        ),
        case(
            &["rank", "--join", "@x", "--rank", "0", "--device", "-1"],
            2,
            "--device",
        ),
        case(&["synth", "--out", "x", "--preset", "huge"], 2, "--preset"),
        case(&["synth", "--out", "x", "--arch", "gpt2"], 2, "--arch"),
        case(&["synth", "--out", "x", "--dtype", "f8"], 2, "--dtype"),
        case(&["synth", "--out", "x", "--seed", "-4"], 2, "--seed"),
    ]);
}

/// config.json: every dimension that sizes an allocation or a loop bounded at parse (1e11
/// layers aborted in an allocation), floats finite and positive (a negative rope_theta or
/// rms_norm_eps generated token 0 forever), mistyped and missing fields, broken files.
#[test]
fn config_fields() {
    let f = fixtures();
    // `how` only names the variant's folder.
    let field = |how: &str, value: Value, culprit: &'static str| {
        let dir = config_with(&format!("cfg-{culprit}-{how}"), culprit, value);
        decode(&dir, &["--max-new-tokens", "2"], 1, culprit)
    };
    let mut cases = vec![
        field("huge", json!(100_000_000_000u64), "num_hidden_layers"),
        field("zero", json!(0), "num_hidden_layers"),
        field("huge", json!(1u64 << 40), "hidden_size"),
        field("string", json!("64"), "hidden_size"),
        field("negative", json!(-1), "intermediate_size"),
        field("huge", json!(1u64 << 30), "vocab_size"),
        field("zero", json!(0), "num_attention_heads"),
        field("uneven", json!(3), "num_key_value_heads"),
        field("odd", json!(7), "head_dim"),
        field("huge", json!(1u64 << 40), "max_position_embeddings"),
        field("negative", json!(-10000.0), "rope_theta"),
        field("zero", json!(0.0), "rope_theta"),
        field("negative", json!(-1e-5), "rms_norm_eps"),
        field("zero", json!(0.0), "rms_norm_eps"),
        field("string", json!("1e-5"), "rms_norm_eps"),
        field("empty", json!([]), "architectures"),
        field("gelu", json!("gelu"), "hidden_act"),
        field("f64", json!("float64"), "torch_dtype"),
        field("string", json!("x"), "eos_token_id"),
        field("string", json!("yes"), "tie_word_embeddings"),
        field("string", json!("yes"), "rope_scaling"),
        field("missing", Value::Null, "num_hidden_layers"),
    ];
    let d = config_with(
        "cfg-rope-factor",
        "rope_scaling",
        json!({"rope_type": "llama3",
        "factor": -8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
    );
    cases.push(decode(&d, &[], 1, "rope_scaling.factor"));
    let d = variant(&f.llama, "cfg-not-object");
    std::fs::write(d.join("config.json"), "[1, 2]").unwrap();
    cases.push(decode(&d, &[], 1, "config.json"));
    let d = variant(&f.llama, "cfg-not-json");
    std::fs::write(d.join("config.json"), "{ \"hidden_size\": 64,").unwrap();
    cases.push(decode(&d, &[], 1, "config.json"));
    let d = variant(&f.llama, "cfg-missing");
    std::fs::remove_file(d.join("config.json")).unwrap();
    cases.push(decode(&d, &[], 1, "config.json"));
    let d = variant(&f.llama, "gen-bad-eos");
    std::fs::write(
        d.join("generation_config.json"),
        r#"{"eos_token_id": [2, "x"]}"#,
    )
    .unwrap();
    cases.push(decode(&d, &[], 1, "generation_config.json"));
    // The tokenizer: missing, not one, not JSON.
    let d = variant(&f.llama, "tok-missing");
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    cases.push(decode(&d, &[], 1, "tokenizer.json"));
    let d = variant(&f.llama, "tok-empty-object");
    std::fs::write(d.join("tokenizer.json"), "{}").unwrap();
    cases.push(decode(&d, &[], 1, "tokenizer.json"));
    let d = variant(&f.llama, "tok-garbage");
    std::fs::write(d.join("tokenizer.json"), [0xffu8, 0xfe, 0, 1, 2]).unwrap();
    cases.push(decode(&d, &[], 1, "tokenizer.json"));
    check_all(&cases);
}

/// Non-finite weights: an error naming the decode step, at every world size, greedy or
/// sampled, whether the whole row is NaN or one logit is, and on the logit-dump path (they
/// generated token 0 over and over, exit 0).
#[test]
fn non_finite_logits_name_the_step() {
    let f = fixtures();
    // Every logit NaN: the final norm's weight.
    let all = variant(&f.llama, "nan-norm");
    poison(&all, "model.norm.weight", 5, f32::NAN);
    // One logit infinite: row 299 of the tied embedding (the LM head) feeds only logit 299,
    // which sits in the last rank's vocab shard.
    let one = variant(&f.llama, "inf-row");
    poison(
        &one,
        "model.embed_tokens.weight",
        299 * 64 + 3,
        f32::INFINITY,
    );
    let mut cases = Vec::new();
    for (dir, world) in [(&all, "1"), (&all, "2"), (&one, "1"), (&one, "3")] {
        for t in ["0", "1"] {
            let mut c = decode(dir, &["--temperature", t, "--max-new-tokens", "4"], 1, "");
            c.args
                .splice(0..0, ["--ranks".to_string(), world.to_string()]);
            c.culprit = "decode step 1 (position";
            cases.push(c);
        }
    }
    let dump = f.dir.join("nan-dump.f32");
    cases.push(decode(
        &all,
        &[
            "--dump-logits",
            dump.to_str().unwrap(),
            "--max-new-tokens",
            "4",
        ],
        1,
        "decode step 1 (position",
    ));
    check_all(&cases);

    // A later step: Qwen3's LM head is its own, so poisoning the embedding row of the first
    // greedy token leaves step 1's logits finite and makes step 2's NaN.
    let prompt = "Hi";
    let env = Env::new("first-token");
    let mut c = env.cmd();
    c.args(["--backend", "cpu", "decode", "--json", "--temperature", "0"])
        .args([
            "--max-new-tokens",
            "1",
            "--ignore-eos",
            "--prompt",
            prompt,
            "--model",
        ])
        .arg(&f.qwen3);
    let v = run_json(c, "the first token");
    let first = v["token_ids"][0].as_u64().unwrap() as usize;
    let prompt_ids: Vec<u64> = v["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert!(
        !prompt_ids.contains(&(first as u64)),
        "choose another prompt"
    );
    env.assert_clean();
    let later = variant(&f.qwen3, "nan-later");
    poison(&later, "model.embed_tokens.weight", first * 64, f32::NAN);
    let (line, _) = check(&decode(
        &later,
        &[
            "--temperature",
            "0",
            "--max-new-tokens",
            "6",
            "--ignore-eos",
            "--prompt",
            prompt,
        ],
        1,
        "decode step 2 (position",
    ));
    assert!(
        line.contains(&format!("(position {})", prompt_ids.len() + 1)),
        "{line}"
    );
}

/// A rank that fails at start-up stops the others, some of them between connect and hello:
/// one error line for the failure, and this job's own ranks are not reported as strangers
/// that were refused. Repeated, since which ranks are cut off mid-hello is a matter of timing.
#[test]
fn an_early_abort_reports_only_the_failure() {
    let mut c = case(
        &["--ranks", "8", "--backend", "cpu", "bench", "allreduce"],
        3,
        "rank 0",
    );
    c.args
        .extend(["--counts", "8", "--iters", "1"].map(String::from));
    c.env.push(("TPRUN_FAULT", "exit:0:start-up".into()));
    for _ in 0..6 {
        let (_, err) = check(&c);
        assert!(!err.contains("refused a connection"), "{err}");
    }
}

/// What is out of range but harmless gives a correct result: a token budget far past the
/// context (allocated by the capped budget, not by the flag), and 0 or 1 new tokens (no NaN
/// in the summary, none in the JSON).
#[test]
fn out_of_range_but_harmless_inputs_give_correct_results() {
    let m = &fixtures().llama;
    let env = Env::new("harmless");
    let mut c = env.cmd();
    c.args([
        "--backend",
        "cpu",
        "decode",
        "--json",
        "--ignore-eos",
        "--max-seq",
        "24",
    ])
    .args([
        "--prompt",
        "Hi",
        "--max-new-tokens",
        "100000000000",
        "--model",
    ])
    .arg(m);
    let v = run_json(c, "a huge --max-new-tokens");
    // A prompt of 3 ids (BOS, H, i) in a cache of 24: 22 more tokens (the last needs no row).
    assert_eq!(v["token_ids"].as_array().unwrap().len(), 22);
    for n in ["0", "1"] {
        let mut c = env.cmd();
        c.args([
            "--backend",
            "cpu",
            "decode",
            "--max-new-tokens",
            n,
            "--model",
        ])
        .arg(m);
        let o = run_ok(c, format!("--max-new-tokens {n}"));
        let err = stderr(&o);
        assert!(!err.contains("NaN") && !err.contains("inf "), "{err}");
        assert!(err.contains(&format!("decode {n} tokens")), "{err}");
        let mut c = env.cmd();
        c.args([
            "--backend",
            "cpu",
            "decode",
            "--json",
            "--max-new-tokens",
            n,
            "--model",
        ])
        .arg(m);
        let v = run_json(c, format!("--max-new-tokens {n} --json"));
        assert!(v["token_latency_p50_ms"].is_null(), "{v}");
    }
    env.assert_clean();
}
