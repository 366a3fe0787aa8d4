//! End-to-end tests of the model shard: the real stories260K checkpoint against the
//! transformers reference, synthetic models of each architecture at several world sizes (ranks
//! as threads, each with its own device, reducing through `LocalComm`), and bad inputs.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use tprun_kernels::cpu::CpuDevice;
use tprun_kernels::DType;

use super::sample::argmax;
use super::synth::SYNTH_BOS;
use super::*;

/// `<repo root>/../shared/models/stories260k` (the worktree's and CI's layout).
fn stories_dir() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/models/stories260k");
    p.join("config.json").exists().then_some(p)
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tprun-model-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `f` on every rank of a `world`-rank job over the model in `dir`, one thread per rank,
/// and returns each rank's result (rank order).
fn run_ranks<R: Send>(
    dir: &Path,
    world: usize,
    opts: &LoadOptions,
    f: impl Fn(&mut Model<CpuDevice>, &mut LocalComm<CpuDevice>) -> R + Sync,
) -> Vec<R> {
    // One op thread per rank; a short spin so that waiting ranks yield the (few) cores.
    let devs: Vec<Arc<CpuDevice>> = (0..world)
        .map(|r| Arc::new(CpuDevice::new(r, 1, 50)))
        .collect();
    let comms = LocalComm::world(&devs, 64 << 10).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .zip(&devs)
            .enumerate()
            .map(|(r, (mut comm, dev))| {
                let f = &f;
                s.spawn(move || {
                    let mut m = Model::load(dev.clone(), dir, r, world, opts).unwrap();
                    f(&mut m, &mut comm)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Greedy generation: prefill, then steps until an eos id or `max_new` tokens. Returns the
/// generated ids and the logits of every forward (prefill's last position first).
fn greedy(
    m: &mut Model<CpuDevice>,
    comm: &mut LocalComm<CpuDevice>,
    prompt: &[u32],
    max_new: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let eos = m.config().eos.clone();
    let mut logits = vec![m.prefill(comm, prompt).unwrap().to_vec()];
    let mut out = Vec::new();
    let mut pos = prompt.len();
    while out.len() < max_new {
        let t = argmax(logits.last().unwrap());
        if eos.contains(&t) {
            break;
        }
        out.push(t);
        logits.push(m.step(comm, t, pos).unwrap().to_vec());
        pos += 1;
    }
    (out, logits)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn stories260k_reproduces_the_transformers_reference_at_every_world_size() {
    let Some(dir) = stories_dir() else {
        println!("skipped: ../shared/models/stories260k not found");
        return;
    };
    let reference: Value =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let prompt = ids(&reference["prompt_token_ids"]);
    let want = ids(&reference["generated_token_ids"]);
    let first20 = &reference["logits_first20"];
    let seq20 = ids(&first20["token_ids"]);
    let ref_logits: Vec<Vec<f32>> = first20["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();

    // The tokenizer's side of the reference (prompt text → ids, ids → text) is the
    // coordinator's test (coordinator/src/tokenizer.rs).
    let close = |got: &[f32], want: &[f32], what: &str| {
        let err = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err <= 1e-4, "{what}: logits differ by {err}");
    };
    for world in [1usize, 2, 4, 8] {
        let results = run_ranks(&dir, world, &LoadOptions::default(), |m, comm| {
            let t0 = std::time::Instant::now();
            // The reference stops at BOS or after 200 tokens past BOS.
            let (gen, logits) = greedy(m, comm, &prompt, 201 - prompt.len());
            let per_token = t0.elapsed() / (gen.len() as u32 + 1);
            // The first 20 positions one token at a time, from position 0.
            let stepped: Vec<Vec<f32>> = seq20
                .iter()
                .enumerate()
                .map(|(p, &t)| m.step(comm, t, p).unwrap().to_vec())
                .collect();
            // The library's decode loop gives the same tokens.
            let sampler = SamplerConfig::default();
            let opts = GenerateOptions {
                max_new_tokens: 201 - prompt.len(),
                stop: m.config().eos.clone(),
            };
            let mut via_generate = Vec::new();
            let st = generate(m, comm, &sampler, &prompt, &opts, &mut |t| {
                via_generate.push(t);
                Ok(true)
            })
            .unwrap();
            assert_eq!(via_generate, gen);
            assert_eq!(st.generated, gen.len());
            (gen, logits, stepped, per_token)
        });
        for (r, (gen, logits, stepped, per_token)) in results.iter().enumerate() {
            assert_eq!(gen, &want, "world {world} rank {r}: generated ids");
            // logits[0] is position prompt.len()-1 (prefill), logits[i] position prompt.len()-1+i.
            for (i, l) in logits.iter().enumerate() {
                let p = prompt.len() - 1 + i;
                if p < 20 {
                    close(
                        l,
                        &ref_logits[p],
                        &format!("world {world} rank {r} position {p} (prefill/step)"),
                    );
                }
            }
            for (p, l) in stepped.iter().enumerate() {
                close(
                    l,
                    &ref_logits[p],
                    &format!("world {world} rank {r} position {p} (step only)"),
                );
            }
            if r == 0 {
                println!(
                    "stories260k world {world}: {} tokens, {per_token:?} per token",
                    gen.len()
                );
            }
        }
    }
}

fn synth_tiny(tag: &str, arch: Arch, dtype: DType) -> PathBuf {
    synth_tiny_quant(tag, arch, dtype, None)
}

fn synth_tiny_quant(
    tag: &str,
    arch: Arch,
    dtype: DType,
    quant: Option<synth::SynthQuant>,
) -> PathBuf {
    let dir = tmpdir(tag);
    let opts = SynthOptions {
        arch,
        preset: Preset::Tiny,
        dtype,
        seed: 7,
        tie_embeddings: None,
        quant,
    };
    let mut calls = 0;
    synth(&dir, &opts, &mut |done, total| {
        assert!(done <= total);
        calls += 1;
    })
    .unwrap();
    assert!(calls > 1);
    dir
}

/// Largest |a − b| over the largest |b| of the reference.
fn rel_err(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let scale = b.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    let err = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    err / scale
}

#[test]
fn synthetic_models_agree_across_world_sizes() {
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        for dtype in [DType::F32, DType::BF16] {
            let dir = synth_tiny(&format!("{arch:?}-{dtype}"), arch, dtype);
            let prompt = synth::synth_ids("Tensor parallel, one rank per core.");
            let run = |world: usize, opts: &LoadOptions| {
                let mut r = run_ranks(&dir, world, opts, |m, comm| greedy(m, comm, &prompt, 12));
                for other in &r[1..] {
                    assert_eq!(
                        other.0, r[0].0,
                        "{arch:?} {dtype} world {world}: ranks disagree"
                    );
                    // Every rank holds bitwise the same logits.
                    assert!(
                        other.1 == r[0].1,
                        "{arch:?} {dtype} world {world}: logits differ between ranks"
                    );
                }
                r.swap_remove(0)
            };
            let (base_ids, base_logits) = run(1, &LoadOptions::default());
            assert_eq!(base_ids.len(), 12);
            // Prefill in chunks of 5 tokens at the larger world sizes: the same math.
            let chunked = LoadOptions {
                prefill_chunk: 5,
                ..LoadOptions::default()
            };
            for world in [2, 3, 4] {
                let (ids, logits) = run(world, &chunked);
                assert_eq!(ids, base_ids, "{arch:?} {dtype} world {world}: tokens");
                let e = rel_err(&logits, &base_logits);
                assert!(
                    e <= 1e-5,
                    "{arch:?} {dtype} world {world}: relative error {e}"
                );
            }
            if arch == Arch::Llama {
                // A bf16 KV cache: the same tokens here, logits within bf16 rounding.
                let kv16 = LoadOptions {
                    kv_dtype: DType::BF16,
                    ..LoadOptions::default()
                };
                let (ids, logits) = run(2, &kv16);
                let e = rel_err(&logits, &base_logits);
                assert!(
                    e <= 2e-2,
                    "{arch:?} {dtype} bf16 kv cache: relative error {e}"
                );
                assert_eq!(ids[..4], base_ids[..4]);
            }
            if dtype == DType::F32 {
                // Converting the f32 file to bf16 at load time gives exactly the bf16 file's
                // model (synth draws the same f32 values and rounds them the same way).
                let as_bf16 = LoadOptions {
                    dtype: Some(DType::BF16),
                    ..LoadOptions::default()
                };
                let bf16_dir = synth_tiny(&format!("{arch:?}-bf16-ref"), arch, DType::BF16);
                let a =
                    run_ranks(&dir, 2, &as_bf16, |m, c| greedy(m, c, &prompt, 4)).swap_remove(0);
                let b = run_ranks(&bf16_dir, 2, &LoadOptions::default(), |m, c| {
                    greedy(m, c, &prompt, 4)
                })
                .swap_remove(0);
                assert!(
                    a == b,
                    "{arch:?}: f32 loaded as bf16 differs from the bf16 file"
                );
                std::fs::remove_dir_all(&bf16_dir).unwrap();
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}

/// Loads rank 0 of `world` and returns the error message.
fn load_err(dir: &Path, world: usize) -> String {
    let dev = Arc::new(CpuDevice::new(0, 1, 10));
    match Model::load(dev, dir, 0, world, &LoadOptions::default()) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_json(path: &Path, f: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, v.to_string()).unwrap();
}

#[test]
fn bad_model_folders_fail_with_a_message_naming_the_culprit() {
    let good = synth_tiny("bad-src", Arch::Llama, DType::F32);
    let fresh = |tag: &str| {
        let d = tmpdir(tag);
        for f in [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
        ] {
            std::fs::copy(good.join(f), d.join(f)).unwrap();
        }
        d
    };
    // (name, how to break the folder, world size, what the message must mention)
    type Case = (&'static str, Box<dyn Fn(&Path)>, usize, Vec<&'static str>);
    let cases: Vec<Case> = vec![
        (
            "no-config",
            Box::new(|d| std::fs::remove_file(d.join("config.json")).unwrap()),
            1,
            vec!["config.json"],
        ),
        (
            "bad-json",
            Box::new(|d| std::fs::write(d.join("config.json"), "{\"hidden_size\": 64,").unwrap()),
            1,
            vec!["config.json", "JSON"],
        ),
        (
            "no-field",
            Box::new(|d| {
                edit_json(&d.join("config.json"), |v| {
                    v.as_object_mut().unwrap().remove("num_hidden_layers");
                })
            }),
            1,
            vec!["config.json", "num_hidden_layers", "missing"],
        ),
        (
            "arch",
            Box::new(|d| {
                edit_json(&d.join("config.json"), |v| {
                    v["architectures"] = serde_json::json!(["MambaForCausalLM"])
                })
            }),
            1,
            vec!["config.json", "architectures", "MambaForCausalLM"],
        ),
        (
            "truncated",
            Box::new(|d| {
                let p = d.join("model.safetensors");
                let b = std::fs::read(&p).unwrap();
                std::fs::write(&p, &b[..b.len() - 100]).unwrap();
            }),
            1,
            vec!["model.safetensors", "truncated"],
        ),
        (
            "header",
            Box::new(|d| {
                let p = d.join("model.safetensors");
                let mut b = std::fs::read(&p).unwrap();
                b[8..14].copy_from_slice(b"\x00\xffxx!!");
                std::fs::write(&p, &b).unwrap();
            }),
            1,
            vec!["model.safetensors", "corrupted header"],
        ),
        (
            "missing-tensor",
            // Untied embeddings need lm_head.weight, which a tied checkpoint does not have.
            Box::new(|d| {
                edit_json(&d.join("config.json"), |v| {
                    v["tie_word_embeddings"] = Value::Bool(false)
                })
            }),
            1,
            vec!["model.safetensors", "lm_head.weight", "missing"],
        ),
        (
            "shape",
            Box::new(|d| {
                edit_json(&d.join("config.json"), |v| {
                    v["intermediate_size"] = serde_json::json!(98)
                })
            }),
            1,
            vec![
                "model.safetensors",
                "model.layers.0.mlp.gate_proj.weight",
                "shape",
            ],
        ),
        (
            "dtype",
            Box::new(|d| {
                let p = d.join("model.safetensors");
                let b = std::fs::read(&p).unwrap();
                let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
                let h = String::from_utf8(b[8..8 + n].to_vec()).unwrap();
                // "I32" has the same width as "F32", so the header keeps its length.
                let h = h.replacen("\"F32\"", "\"I32\"", 1);
                let mut out = b[..8].to_vec();
                out.extend_from_slice(h.as_bytes());
                out.extend_from_slice(&b[8 + n..]);
                std::fs::write(&p, out).unwrap();
            }),
            1,
            vec!["model.safetensors", "I32"],
        ),
        (
            "heads",
            Box::new(|_| {}),
            6,
            vec!["6 ranks", "num_key_value_heads"],
        ),
        ("heads-q", Box::new(|_| {}), 16, vec!["query heads"]),
    ];
    for (tag, break_it, world, needles) in cases {
        let d = fresh(tag);
        break_it(&d);
        let e = load_err(&d, world);
        for n in needles {
            assert!(e.contains(n), "{tag}: {e:?} should mention {n:?}");
        }
        std::fs::remove_dir_all(&d).unwrap();
    }
    // A missing or broken tokenizer.json is the coordinator's test (it owns the tokenizer).
    std::fs::remove_dir_all(&good).unwrap();
}

/// Decode speed of the `small` synthetic model (58M parameters, bf16) at 1 and 2 ranks:
/// `cargo test --release -p tprun-rank small_model_decode_speed -- --ignored --nocapture`
#[test]
#[ignore]
fn small_model_decode_speed() {
    let dir = tmpdir("small-bench");
    let opts = SynthOptions {
        arch: Arch::Llama,
        preset: Preset::Small,
        dtype: DType::BF16,
        seed: 1,
        tie_embeddings: None,
        quant: None,
    };
    synth(&dir, &opts, &mut |_, _| {}).unwrap();
    let prompt: Vec<u32> = (0..64).map(|i| 3 + i * 7).collect();
    for world in [1usize, 2] {
        let stats = run_ranks(&dir, world, &LoadOptions::default(), |m, comm| {
            let s = SamplerConfig::default();
            let g = GenerateOptions {
                max_new_tokens: 64,
                stop: vec![],
            };
            generate(m, comm, &s, &prompt, &g, &mut |_| Ok(true)).unwrap()
        });
        let st = &stats[0];
        println!(
            "small bf16 world {world}: prefill {} tokens in {:?}, decode {:.1} tokens/s",
            st.prompt_tokens,
            st.prefill,
            st.decode_tokens_per_s()
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The same model stored as two shard files plus `model.safetensors.index.json` loads to the
/// same logits as the single file.
#[test]
fn sharded_checkpoint_equals_single_file() {
    let single = synth_tiny("single", Arch::Qwen2, DType::BF16);
    let split = tmpdir("split");
    for f in ["config.json", "generation_config.json", "tokenizer.json"] {
        std::fs::copy(single.join(f), split.join(f)).unwrap();
    }
    let ck = safetensors::Checkpoint::open(&single).unwrap();
    let (file, _) = ck.info("model.norm.weight").unwrap();
    let mut names: Vec<String> = file.tensors().keys().cloned().collect();
    names.sort();
    let half = names.len() / 2;
    let mut weight_map = serde_json::Map::new();
    for (i, part) in [&names[..half], &names[half..]].into_iter().enumerate() {
        let fname = format!("model-0000{}-of-00002.safetensors", i + 1);
        let list: Vec<(String, DType, Vec<usize>)> = part
            .iter()
            .map(|n| {
                let (_, t) = ck.info(n).unwrap();
                (n.clone(), t.dtype().unwrap(), t.shape.clone())
            })
            .collect();
        safetensors::write(&split.join(&fname), &list, &mut |j, out| {
            let (n, dt, shape) = &list[j];
            let mut res = Ok(());
            ck.read(n, shape, &safetensors::Slice::Full, *dt, &mut |_, b| {
                res = out(b);
                Ok(())
            })
            .unwrap();
            res
        })
        .unwrap();
        for n in part {
            weight_map.insert(n.clone(), Value::String(fname.clone()));
        }
    }
    std::fs::write(
        split.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();
    let prompt = [SYNTH_BOS, 72, 105];
    let a = run_ranks(&single, 2, &LoadOptions::default(), |m, c| {
        greedy(m, c, &prompt, 4)
    });
    let b = run_ranks(&split, 2, &LoadOptions::default(), |m, c| {
        greedy(m, c, &prompt, 4)
    });
    assert!(a == b, "sharded checkpoint differs");
    std::fs::remove_dir_all(&single).unwrap();
    std::fs::remove_dir_all(&split).unwrap();
}

/// Qwen3.5 (gated DeltaNet layers and gated, partially rotated attention) over 1, 2 and 4
/// ranks: the same greedy tokens, logits within 1e-5 of one rank's, every rank of a world
/// bitwise alike; at 2 and 4 ranks the prompt is prefilled in chunks of 5, which carries the
/// recurrent states across chunks.
#[test]
fn qwen35_agrees_across_world_sizes() {
    for dtype in [DType::F32, DType::BF16] {
        let dir = synth_tiny(&format!("qwen35-{dtype}"), Arch::Qwen3_5, dtype);
        let prompt = synth::synth_ids("Gated deltas, one rank per core.");
        let run = |world: usize, opts: &LoadOptions| {
            let mut r = run_ranks(&dir, world, opts, |m, comm| greedy(m, comm, &prompt, 12));
            for other in &r[1..] {
                assert!(other == &r[0], "{dtype} world {world}: ranks disagree");
            }
            r.swap_remove(0)
        };
        let (base_ids, base_logits) = run(1, &LoadOptions::default());
        assert_eq!(base_ids.len(), 12);
        assert!(base_logits.iter().flatten().all(|l| l.is_finite()));
        let chunked = LoadOptions {
            prefill_chunk: 5,
            ..LoadOptions::default()
        };
        for world in [2, 4] {
            let (ids, logits) = run(world, &chunked);
            assert_eq!(ids, base_ids, "{dtype} world {world}: tokens");
            let e = rel_err(&logits, &base_logits);
            assert!(e <= 1e-5, "{dtype} world {world}: relative error {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The DeltaNet states a prompt leaves when prefilled in one pass equal those of running it
/// token by token: the next-token logits agree (the states feed every later token), and so
/// do the tokens that the on-device sampler (`begin` + `decode`) then picks; a second request
/// on the same model starts from zeroed states.
#[test]
fn qwen35_prefill_leaves_the_token_by_token_state() {
    let dir = synth_tiny("qwen35-state", Arch::Qwen3_5, DType::F32);
    let prompt = synth::synth_ids("Recurrent state, carried.");
    let greedy_p = ops_params();
    let out = run_ranks(&dir, 1, &LoadOptions::default(), |m, comm| {
        let whole = m.prefill(comm, &prompt).unwrap().to_vec();
        let next = argmax(&whole);
        let after_whole = m.step(comm, next, prompt.len()).unwrap().to_vec();
        // The same prompt one token at a time (a new sequence: states reset).
        let mut by_token = m.prefill(comm, &prompt[..1]).unwrap().to_vec();
        for (p, &t) in prompt.iter().enumerate().skip(1) {
            by_token = m.step(comm, t, p).unwrap().to_vec();
        }
        let after_tokens = m.step(comm, next, prompt.len()).unwrap().to_vec();
        // A hybrid cannot rewind its recurrent state.
        let e = m.step(comm, next, 2).unwrap_err().to_string();
        assert!(e.contains("cannot rewind"), "{e}");
        // begin + decode, twice: the second request sees fresh states.
        let mut runs = Vec::new();
        for _ in 0..2 {
            let first = m.begin(comm, &prompt, &greedy_p).unwrap();
            let mut toks = vec![first];
            m.decode(comm, &greedy_p, 6, &mut |t| {
                toks.push(t);
                Ok(true)
            })
            .unwrap();
            runs.push(toks);
        }
        (whole, by_token, after_whole, after_tokens, runs)
    })
    .swap_remove(0);
    let (whole, by_token, after_whole, after_tokens, runs) = out;
    assert!(rel_err(&[by_token], std::slice::from_ref(&whole)) <= 1e-5);
    assert!(rel_err(&[after_tokens], &[after_whole]) <= 1e-5);
    assert_eq!(runs[0], runs[1]);
    let (ids, _) = run_ranks(&dir, 1, &LoadOptions::default(), |m, c| {
        greedy(m, c, &prompt, 7)
    })
    .swap_remove(0);
    assert_eq!(runs[0], ids);
    assert_eq!(runs[0][0], argmax(&whole));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn ops_params() -> tprun_kernels::ops::SampleParams {
    tprun_kernels::ops::SampleParams {
        temperature: 0.0,
        top_k: 1,
        top_p: 1.0,
        seed: 0,
    }
}

/// A Qwen3.5 folder missing a DeltaNet tensor, or with a mis-shaped one, fails naming it.
#[test]
fn qwen35_bad_tensors_are_named() {
    let dir = synth_tiny("qwen35-bad", Arch::Qwen3_5, DType::F32);
    edit_json(&dir.join("config.json"), |v| {
        v["text_config"]["linear_conv_kernel_dim"] = serde_json::json!(3);
    });
    let e = load_err(&dir, 1);
    assert!(
        e.contains("linear_attn.conv1d.weight") && e.contains("shape"),
        "{e}"
    );
    edit_json(&dir.join("config.json"), |v| {
        v["text_config"]["linear_conv_kernel_dim"] = serde_json::json!(4);
        v["text_config"]["linear_num_key_heads"] = serde_json::json!(2);
        v["text_config"]["linear_num_value_heads"] = serde_json::json!(4);
    });
    let e = load_err(&dir, 4);
    assert!(e.contains("linear_num_key_heads 2"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The tiny Qwen3.5 that transformers itself built and ran (rank/tests/fixtures/qwen35-tiny,
/// written by scripts/ref_qwen35.py: 3 DeltaNet layers and 1 gated attention layer, bf16
/// weights, transformers computing in f32): the same 12 greedy tokens exactly and every
/// step's logits within 1e-4, at 1, 2 and 4 ranks.
#[test]
fn qwen35_reproduces_the_transformers_fixture_at_every_world_size() {
    check_fixture("qwen35-tiny", |err, _| err <= 1e-4);
}

/// The same model with its MLP in GPTQ int4 (rank/tests/fixtures/qwen35-tiny-gptq: sym,
/// group 32, v1 zeros stored as 7, attention and DeltaNet kept bf16 by a `dynamic` rule),
/// against transformers run on its exactly dequantised bf16 twin: the same greedy tokens and
/// logits within 1e-3 of the largest reference logit, at 1, 2 and 4 ranks (4 ranks split the
/// 128 MLP columns in whole groups of 32).
#[test]
fn qwen35_gptq_reproduces_its_dequantised_twin_at_every_world_size() {
    check_fixture("qwen35-tiny-gptq", |err, scale| err <= 1e-3 * scale);
}

/// Greedy tokens exactly, and `ok(largest logit difference, largest |reference logit|)`,
/// for the fixture `name` at 1, 2 and 4 ranks.
fn check_fixture(name: &str, ok: impl Fn(f32, f32) -> bool) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let reference: Value =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let prompt = ids(&reference["prompt"]);
    let want = ids(&reference["tokens"]);
    let want_logits: Vec<Vec<f32>> = reference["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    let scale = want_logits
        .iter()
        .flatten()
        .fold(0f32, |m, x| m.max(x.abs()));
    for world in [1, 2, 4] {
        let r = run_ranks(&dir, world, &LoadOptions::default(), |m, comm| {
            greedy(m, comm, &prompt, want.len())
        });
        let (tokens, logits) = &r[0];
        assert_eq!(tokens, &want, "{name}, world {world}: greedy tokens");
        let err = logits
            .iter()
            .zip(&want_logits)
            .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
            .fold(0f32, f32::max);
        eprintln!(
            "{name}, world {world}: largest logit difference {err:e} (largest logit {scale})"
        );
        assert!(
            ok(err, scale),
            "{name}, world {world}: logits differ by {err}"
        );
    }
}

/// The tiny Qwen3.5 of `synth --quant gptq-int4` in both zero conventions, with and without
/// act-order (`desc_act`: `g_idx` not monotone), against its dequantised dense twin (`synth`
/// with `dequantised`: the same model, its MLP in f32 holding what the int4 values stand
/// for): the same greedy tokens and logits within 1e-4 of the largest, at 1 and 2 ranks (2
/// ranks split down_proj's inputs in whole groups, which act-order scatters over K). A Llama
/// with a quantized MLP takes the same path.
#[test]
fn gptq_synth_matches_its_dequantised_twin() {
    use super::gptq::ZeroFormat;
    let prompt = synth::synth_ids("Four bits a weight.");
    for arch in [Arch::Qwen3_5, Arch::Llama] {
        for desc_act in [false, true] {
            for format in [ZeroFormat::V1, ZeroFormat::V2] {
                check_gptq_twin(arch, desc_act, format, &prompt);
            }
        }
    }
}

fn check_gptq_twin(arch: Arch, desc_act: bool, format: super::gptq::ZeroFormat, prompt: &[u32]) {
    let tag = format!("gptq-{arch:?}-{}-{desc_act}", format.name());
    let q = |dequantised| synth::SynthQuant {
        group_size: Some(32),
        desc_act,
        format,
        dequantised,
    };
    let dir = synth_tiny_quant(&tag, arch, DType::BF16, Some(q(false)));
    let twin = synth_tiny_quant(&format!("{tag}-twin"), arch, DType::BF16, Some(q(true)));
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    assert!(cfg.gptq.is_some() && ModelConfig::from_dir(&twin).unwrap().gptq.is_none());
    let ck = safetensors::Checkpoint::open(&dir).unwrap();
    let g_idx = ck
        .read_i32(
            &format!("{}layers.0.mlp.down_proj.g_idx", weights::text_prefix(&cfg)),
            &[128],
            &safetensors::Slice::Full,
        )
        .unwrap();
    assert_eq!(g_idx.is_sorted(), !desc_act, "{tag}: g_idx order");
    let run = |dir: &Path, world| {
        run_ranks(dir, world, &LoadOptions::default(), |m, c| {
            greedy(m, c, prompt, 8)
        })
        .swap_remove(0)
    };
    let (want, want_logits) = run(&twin, 1);
    for world in [1, 2] {
        let (ids, logits) = run(&dir, world);
        assert_eq!(ids, want, "{tag} world {world}: tokens");
        let e = rel_err(&logits, &want_logits);
        assert!(e <= 1e-4, "{tag} world {world}: relative error {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&twin).unwrap();
}

/// A malformed GPTQ checkpoint fails to load with one line naming the fault: 3-bit weights,
/// a group size that does not divide K, a qweight of the wrong shape, rules that quantize
/// the token mixers (only the MLP has an int4 path).
#[test]
fn gptq_malformed_checkpoints_fail_with_one_line() {
    let quant = synth::SynthQuant {
        group_size: Some(32),
        desc_act: false,
        format: super::gptq::ZeroFormat::V1,
        dequantised: false,
    };
    let dir = synth_tiny_quant("gptq-bad", Arch::Qwen3_5, DType::BF16, Some(quant));
    let config = dir.join("config.json");
    let original = std::fs::read(&config).unwrap();
    // (what, the config edit, what the error must name)
    type Case = (&'static str, fn(&mut Value), &'static [&'static str]);
    let cases: [Case; 4] = [
        (
            "bits 3",
            |v| v["quantization_config"]["bits"] = serde_json::json!(3),
            &["bits", "3"],
        ),
        (
            "group 48",
            |v| v["quantization_config"]["group_size"] = serde_json::json!(48),
            &[
                "mlp.down_proj",
                "group_size 48 does not divide in_features 128",
            ],
        ),
        (
            // 160 MLP columns in the config, 128 in the file: every qweight is too narrow.
            "qweight shape",
            |v| v["text_config"]["intermediate_size"] = serde_json::json!(160),
            &["mlp.gate_proj.qweight", "shape"],
        ),
        (
            // No rule keeping the token mixers dense: their (absent) int4 is refused.
            "mixer quantized",
            |v| v["quantization_config"]["dynamic"] = serde_json::json!({}),
            &["linear_attn.in_proj_qkv is quantized", "only the MLP"],
        ),
    ];
    for (what, edit, want) in cases {
        std::fs::write(&config, &original).unwrap();
        edit_json(&config, edit);
        let e = load_err(&dir, 1);
        eprintln!("{what}: {e}");
        assert!(!e.contains('\n'), "{what}: more than one line: {e}");
        for w in want {
            assert!(e.contains(w), "{what}: {e:?} does not name {w}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A model the backend's kernels cannot take fails at load with one line naming the setting
/// and the bound; one that fits, or the unbounded CPU backend, passes; dense models have no
/// DeltaNet bound at all.
#[test]
fn kernel_limits_are_checked_at_load() {
    use crate::model::forward::fits_kernels;
    use crate::model::synth::config_for;
    use crate::model::{Arch, Preset, SynthOptions};
    use tprun_kernels::OpLimits;
    let opts = |arch| SynthOptions {
        arch,
        preset: Preset::Tiny,
        dtype: DType::F32,
        seed: 0,
        tie_embeddings: None,
        quant: None,
    };
    let gpu = OpLimits {
        conv_taps: 8,
        delta_dk: 256,
    };
    let mut cfg = config_for(&opts(Arch::Qwen3_5));
    fits_kernels(&cfg, "cuda", gpu).unwrap();
    let h = cfg.hybrid.as_mut().unwrap();
    h.dk = 512;
    h.conv_kernel = 12;
    let e = fits_kernels(&cfg, "cuda", gpu).unwrap_err().to_string();
    assert!(
        e.contains("linear_conv_kernel_dim 12 (at most 8)")
            && e.contains("linear_key_head_dim 512 (at most 256)")
            && e.contains("cuda")
            && !e.contains('\n'),
        "{e}"
    );
    fits_kernels(&cfg, "cpu", OpLimits::NONE).unwrap();
    fits_kernels(&config_for(&opts(Arch::Llama)), "cuda", gpu).unwrap();
}

/// Continuous batching: sequences that join a batch at different steps (prefilled alone, or
/// in the batched step itself next to the others' tokens), leave it when done and hand their
/// cache slot to the next, each get bitwise the tokens they get alone (greedy and seeded
/// sampling), at world 1 and 2 (CPU backend).
#[test]
fn batched_steps_give_each_sequence_its_tokens_alone() {
    let dir = synth_tiny("batch", Arch::Qwen3, DType::BF16);
    let opts = LoadOptions {
        slots: 3,
        max_seq: Some(64),
        ..LoadOptions::default()
    };
    // (prompt, tokens to generate, temperature, seed, the step it arrives at)
    let seqs: Vec<(Vec<u32>, usize, f32, u64, usize)> = vec![
        (vec![SYNTH_BOS, 5, 9, 14], 9, 0.0, 0, 0),
        (vec![SYNTH_BOS, 40, 41], 4, 0.9, 11, 0),
        (vec![SYNTH_BOS, 7, 7, 7, 7, 7, 7, 7, 7, 3], 12, 0.0, 0, 2),
        (vec![SYNTH_BOS, 100], 6, 1.3, 5, 3),
        (vec![SYNTH_BOS, 60, 61, 62, 63, 64], 7, 0.0, 0, 5),
    ];
    let params = |t: f32, seed: u64| tprun_kernels::ops::SampleParams {
        temperature: t,
        top_k: 0,
        top_p: 0.95,
        seed,
    };
    for world in [1, 2] {
        let runs = run_ranks(&dir, world, &opts, |m, comm| {
            let alone: Vec<Vec<u32>> = seqs
                .iter()
                .map(|(prompt, n, t, seed, _)| {
                    let p = params(*t, *seed);
                    let mut out = vec![m.begin(comm, prompt, &p).unwrap()];
                    m.decode(comm, &p, n - 1, &mut |t| {
                        out.push(t);
                        Ok(out.len() < *n)
                    })
                    .unwrap();
                    out
                })
                .collect();
            // (sequence, slot, its tokens so far)
            let mut running: Vec<(usize, usize, Vec<u32>)> = Vec::new();
            let mut got = vec![Vec::new(); seqs.len()];
            let (mut next, mut step) = (0, 0);
            while next < seqs.len() || !running.is_empty() {
                // Even sequences start in a batched step (their prompt among its rows), odd
                // ones are prefilled alone first.
                let mut starting: Vec<(usize, usize)> = Vec::new();
                while next < seqs.len()
                    && seqs[next].4 <= step
                    && running.len() + starting.len() < m.slots()
                {
                    let slot = (0..m.slots())
                        .find(|s| {
                            running.iter().all(|r| r.1 != *s) && starting.iter().all(|r| r.1 != *s)
                        })
                        .unwrap();
                    let (prompt, _, t, seed, _) = &seqs[next];
                    if next % 2 == 0 {
                        starting.push((next, slot));
                    } else {
                        let first = m.begin_in(comm, slot, prompt, &params(*t, *seed)).unwrap();
                        running.push((next, slot, vec![first]));
                    }
                    next += 1;
                }
                let starts: Vec<BatchStart> = starting
                    .iter()
                    .map(|&(i, slot)| BatchStart {
                        slot,
                        prompt: &seqs[i].0,
                        params: params(seqs[i].2, seqs[i].3),
                    })
                    .collect();
                let rows: Vec<BatchRow> = running
                    .iter()
                    .map(|(i, slot, toks)| BatchRow {
                        slot: *slot,
                        token: *toks.last().unwrap(),
                        pos: seqs[*i].0.len() + toks.len() - 1,
                        params: params(seqs[*i].2, seqs[*i].3),
                    })
                    .collect();
                let new = m.step_batch(comm, &rows, &starts).unwrap();
                for (r, &t) in running.iter_mut().zip(&new) {
                    r.2.push(t);
                }
                for (&(i, slot), &t) in starting.iter().zip(&new[rows.len()..]) {
                    running.push((i, slot, vec![t]));
                }
                for r in running.iter().filter(|r| r.2.len() >= seqs[r.0].1) {
                    got[r.0] = r.2[..seqs[r.0].1].to_vec();
                }
                running.retain(|r| r.2.len() < seqs[r.0].1);
                step += 1;
            }
            (alone, got)
        });
        for (alone, got) in runs {
            assert_eq!(got, alone, "world {world}");
        }
    }
    // More rows than slots, or one slot twice, is refused.
    let errs = run_ranks(&dir, 1, &opts, |m, comm| {
        let p = params(0.0, 0);
        m.begin_in(comm, 0, &[SYNTH_BOS, 1], &p).unwrap();
        let row = BatchRow {
            slot: 0,
            token: 1,
            pos: 2,
            params: p,
        };
        let twice = m
            .step_batch(comm, &[row, row], &[])
            .unwrap_err()
            .to_string();
        let far = BatchRow { slot: 3, ..row };
        let beyond = m.step_batch(comm, &[far], &[]).unwrap_err().to_string();
        (twice, beyond)
    });
    assert!(errs[0].0.contains("slot 0"), "{}", errs[0].0);
    assert!(errs[0].1.contains("slot 3"), "{}", errs[0].1);
    std::fs::remove_dir_all(&dir).unwrap();
}
