//! What the fuzz targets in `fuzz/` run (cargo fuzz, nightly), and the replay of their
//! committed inputs as ordinary tests (stable), so both go through the same functions.
//!
//! Each entry point takes arbitrary bytes, feeds them to the code a rank runs on that input,
//! and panics only where an invariant breaks: an error is a correct answer to bad input, a
//! panic, an abort or an allocation failure is a bug. Not an API (hidden from the docs).

use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::Path;

use tprun_ipc::control::MAX_RANKS;
use tprun_ipc::wire;
use tprun_kernels::DType;

use crate::model::safetensors::{self, Slice};
use crate::model::{ModelConfig, ShardPlan};
use crate::run::RankOptions;

/// The job token of the `wire` target's rank; a seed's control block carries its hash.
pub const TOKEN: [u8; 16] = *b"tprun-fuzz-token";

/// The `wire` target's rank: rank 0 of a job with [`TOKEN`], at an address that is never
/// connected to (it only names the coordinator in the handshake's errors).
fn fuzz_rank() -> RankOptions {
    RankOptions {
        socket: "@tprun-fuzz".into(),
        rank: 0,
        token: TOKEN,
    }
}

/// Bytes the `wire` target's control-block memfd is padded to: at least the block's size
/// (the control module asserts it is under 1 MiB), so that a short image reaches the header
/// checks instead of stopping at the size check every time. Sparse: costs no memory.
const CONTROL_FILE: u64 = 1 << 20;

/// `wire`: `[frame length: u16 LE][frame][control-block image]`. The frame goes through the
/// decoder a coordinator and a rank use for every message; a decoded message must encode
/// again to the same message. A `Welcome` then goes through the rank's side of the
/// handshake ([`crate::run::admitted`]) with the image as the control block's memfd.
pub fn wire(data: &[u8]) {
    let (frame, image) = match data {
        [a, b, rest @ ..] => {
            rest.split_at(usize::from(u16::from_le_bytes([*a, *b])).min(rest.len()))
        }
        _ => (data, &[][..]),
    };
    let Ok(msg) = wire::decode(frame) else {
        return;
    };
    let again = wire::encode(&msg).expect("a decoded message encodes");
    assert_eq!(wire::decode(&again).expect("its own encoding decodes"), msg);
    let fds: Vec<OwnedFd> = match image {
        [] => vec![],
        _ => vec![control_file(image)],
    };
    if let Ok((world, _plan, control)) = crate::run::admitted(msg, fds, &fuzz_rank()) {
        assert!((1..=MAX_RANKS).contains(&world), "world {world} admitted");
        // What a rank and the coordinator read of every slot in errors and stall checks.
        let _ = control.aborted();
        for r in 0..world {
            let _ = (
                control.phase_name(r),
                control.heartbeat(r),
                control.error(r),
            );
        }
    }
}

fn control_file(image: &[u8]) -> OwnedFd {
    let fd = nix::sys::memfd::memfd_create(c"tprun-fuzz", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
        .expect("memfd_create");
    let mut f = std::fs::File::from(fd);
    f.write_all(image).expect("writing the memfd");
    f.set_len(CONTROL_FILE.max(image.len() as u64))
        .expect("sizing the memfd");
    f.into()
}

/// `safetensors`: the bytes as a whole safetensors file (header parsed and validated, then
/// every tensor read whole and by rows and columns, converted), and, when they are UTF-8, as
/// a `model.safetensors.index.json`.
pub fn safetensors(data: &[u8]) {
    let path = Path::new("fuzz.safetensors");
    if let Ok(tensors) = safetensors::parse(path, data) {
        let mut names: Vec<&String> = tensors.keys().collect();
        names.sort();
        for name in names {
            let t = &tensors[name];
            let shape = t.shape.as_slice();
            let rows = shape.first().copied().unwrap_or(1);
            let numel: usize = shape.iter().product();
            let mut slices = vec![
                (Slice::Full, numel),
                (
                    Slice::Rows(rows / 2..rows),
                    numel / rows.max(1) * (rows - rows / 2),
                ),
            ];
            if let [r, c] = *shape {
                slices.push((Slice::Cols(c / 2..c), r * (c - c / 2)));
            }
            for (slice, elems) in slices {
                for dtype in [DType::F32, DType::BF16] {
                    let mut got = 0;
                    let read = safetensors::read_slice(
                        path,
                        data,
                        name,
                        t,
                        shape,
                        &slice,
                        dtype,
                        &mut |off, bytes| {
                            assert_eq!(off, got, "the sink's offsets follow each other");
                            got += bytes.len();
                            Ok(())
                        },
                    );
                    if read.is_ok() {
                        assert_eq!(got, elems * dtype.size(), "{name}: {slice:?} of {shape:?}");
                    }
                }
            }
        }
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let index = Path::new("model.safetensors.index.json");
        if let Ok(map) = safetensors::parse_index(index, text) {
            for (_, file) in map {
                // Joined to the model folder, a name must stay inside it.
                let p = Path::new(&file);
                assert!(
                    p.components().count() == 1
                        && matches!(p.components().next(), Some(std::path::Component::Normal(_))),
                    "{file:?} accepted as a file name"
                );
            }
        }
    }
}

/// `model_config`: `config.json` text, optionally followed by a NUL byte and
/// `generation_config.json` text, parsed as a rank does; a config that parses is then split
/// over every world size up to [`MAX_RANKS`], and each split must cover the model exactly.
pub fn model_config(data: &[u8]) {
    let (config, gen) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], Some(&data[i + 1..])),
        None => (data, None),
    };
    let (Ok(config), Ok(gen)) = (
        std::str::from_utf8(config),
        gen.map(std::str::from_utf8).transpose(),
    ) else {
        return;
    };
    let gen_path = Path::new("generation_config.json");
    let Ok(cfg) = ModelConfig::from_texts(
        (Path::new("config.json"), config),
        gen.map(|g| (gen_path, g)),
    ) else {
        return;
    };
    for world in 1..=MAX_RANKS {
        let plans: Vec<ShardPlan> = match (0..world)
            .map(|r| ShardPlan::new(&cfg, r, world))
            .collect::<Result<_, _>>()
        {
            Ok(p) => p,
            Err(_) => continue,
        };
        let mut inter = 0;
        let mut vocab = 0;
        let mut heads = 0;
        for p in &plans {
            assert!(!p.q_heads.is_empty() && p.q_heads.end <= cfg.heads, "{p:?}");
            assert!(
                !p.kv_heads.is_empty() && p.kv_heads.end <= cfg.kv_heads,
                "{p:?}"
            );
            assert_eq!(p.inter.start, inter, "MLP columns tile: {p:?}");
            assert_eq!(p.vocab.start, vocab, "vocab rows tile: {p:?}");
            inter = p.inter.end;
            vocab = p.vocab.end;
            heads += p.q_heads.len();
        }
        assert_eq!(
            (inter, vocab, heads),
            (cfg.intermediate, cfg.vocab, cfg.heads),
            "world {world}: every column, row and head on exactly one rank"
        );
    }
}

/// Runs `f` on every file of `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/` under
/// `fuzz_dir`, and returns how many there were. For each crate's replay test.
pub fn replay(fuzz_dir: &Path, target: &str, f: fn(&[u8])) -> usize {
    let mut n = 0;
    for kind in ["corpus", "regressions"] {
        let dir = fuzz_dir.join(kind).join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut files: Vec<_> = entries.map(|e| e.expect("listing").path()).collect();
        files.sort();
        for file in files {
            let data = std::fs::read(&file).expect("reading a corpus file");
            // Named on failure: the panic's message is the input's.
            eprintln!("replaying {}", file.display());
            f(&data);
            n += 1;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fuzz_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
    }

    /// Writes the seed inputs of the rank's targets into `fuzz/corpus/` (run by hand when a
    /// format changes: `cargo test -p tprun-rank write_fuzz_seeds -- --ignored`).
    #[test]
    #[ignore]
    fn write_fuzz_seeds() {
        use crate::job::{self, Backend, BenchRow, BenchSpec, DecodeSpec, JobSpec, Plan, Task};
        use crate::model::synth::{config_for, SynthOptions};
        use crate::model::{Arch, Preset};
        use tprun_ipc::{ControlBlock, Msg};

        let seed = |target: &str, name: &str, bytes: &[u8]| {
            let dir = fuzz_dir().join("corpus").join(target);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
        };

        // wire: frames of each side of the handshake, a Welcome with a real plan and block.
        let framed = |msg: &Msg, image: &[u8]| {
            let f = wire::encode(msg).unwrap();
            let mut v = (f.len() as u16).to_le_bytes().to_vec();
            v.extend_from_slice(&f);
            v.extend_from_slice(image);
            v
        };
        let spec = |task| JobSpec {
            backend: Backend::Cpu,
            ipc: tprun_kernels::IpcMode::Auto,
            comm: Default::default(),
            pdl: false,
            timeout_ms: 60_000,
            threads: 1,
            oversubscribed: false,
            task,
        };
        let decode = Task::Decode(DecodeSpec {
            model: job::ModelSpec {
                source: job::ModelSource::Dir("/m".into()),
                dtype: None,
                kv_dtype: DType::BF16,
                max_seq: Some(64),
                graph: false,
            },
            dump_logits: None,
            prompt: vec![1, 2, 3],
            max_new_tokens: 8,
            stop: vec![2],
            temperature: 0.0,
            top_k: 40,
            top_p: 0.95,
            seed: 0,
            no_allreduce: false,
            profile: false,
        });
        let bench = Task::Bench(BenchSpec {
            rows: vec![BenchRow {
                algo: job::Algo::Oneshot,
                dtype: DType::F32,
                count: 1024,
                warmup: 2,
                iters: 5,
            }],
            check: true,
        });
        let block = ControlBlock::create(2, &TOKEN).unwrap();
        let mut image = vec![0u8; 64];
        nix::sys::uio::pread(block.fd(), &mut image, 0).unwrap();
        for (name, task) in [("welcome-decode", decode), ("welcome-bench", bench)] {
            let plan = Plan {
                job: spec(task),
                device: 1,
            };
            let msg = Msg::Welcome {
                world: 2,
                job: job::encode(&plan),
            };
            seed("wire", name, &framed(&msg, &image));
        }
        let hello = Msg::Hello {
            token: TOKEN,
            rank: 1,
            pid: 42,
        };
        seed("wire", "hello", &framed(&hello, &[]));
        let export = Msg::Export {
            device: "cpu".into(),
            device_uuid: "cpu-0".into(),
            items: vec![tprun_ipc::wire::ExportItem {
                meta: vec![1, 2, 3],
                has_fd: true,
            }],
        };
        seed("wire", "export", &framed(&export, &[]));
        let refused = Msg::Refused {
            reason: "wrong job token".into(),
        };
        seed("wire", "refused", &framed(&refused, &[]));

        // safetensors: a small file of each dtype and shape kind, and an index.
        let dir = std::env::temp_dir().join(format!("tprun-fuzz-seed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("m.safetensors");
        let list = [
            ("embed".to_string(), DType::BF16, vec![3, 4]),
            ("norm".to_string(), DType::F32, vec![4]),
            ("scalar".to_string(), DType::F16, vec![]),
        ];
        let vals: Vec<f32> = (0..12).map(|i| i as f32 / 4.0).collect();
        safetensors::write(&file, &list, &mut |i, out| {
            let (_, dt, shape) = &list[i];
            let n: usize = shape.iter().product();
            out(&tprun_kernels::dtype::encode(*dt, &vals[..n]))
        })
        .unwrap();
        seed("safetensors", "file", &std::fs::read(&file).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
        seed(
            "safetensors",
            "index.json",
            br#"{"metadata": {"total_size": 16}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#,
        );

        // model_config: each architecture's config as synth writes it, with and without a
        // generation_config.json, and stories260k's pair where the folder is there.
        for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
            let opts = SynthOptions {
                arch,
                preset: Preset::Tiny,
                dtype: DType::BF16,
                seed: 0,
                tie_embeddings: None,
                quant: None,
            };
            let mut text = config_for(&opts).to_json().to_string().into_bytes();
            if arch == Arch::Qwen2 {
                text.push(0);
                text.extend_from_slice(br#"{"bos_token_id": 1, "eos_token_id": [2, 3]}"#);
            }
            seed("model_config", arch.model_type(), &text);
        }
        let llama8b = SynthOptions {
            arch: Arch::Llama,
            preset: Preset::Llama3_8b,
            dtype: DType::BF16,
            seed: 0,
            tie_embeddings: None,
            quant: None,
        };
        let text = config_for(&llama8b).to_json().to_string();
        seed("model_config", "llama3-8b", text.as_bytes());
        let stories = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/models/stories260k");
        if let (Ok(c), Ok(g)) = (
            std::fs::read(stories.join("config.json")),
            std::fs::read(stories.join("generation_config.json")),
        ) {
            seed("model_config", "stories260k", &[c, vec![0], g].concat());
        }
    }

    /// The Welcome seeds reach the end of the rank's handshake (so the fuzzer starts from
    /// inputs that pass every check, and mutates from there).
    #[test]
    fn welcome_seeds_are_admitted() {
        for name in ["seed-welcome-decode", "seed-welcome-bench"] {
            let data = std::fs::read(fuzz_dir().join("corpus/wire").join(name)).unwrap();
            let n = usize::from(u16::from_le_bytes([data[0], data[1]]));
            let (frame, image) = data[2..].split_at(n);
            let msg = wire::decode(frame).unwrap();
            let (world, plan, _) =
                crate::run::admitted(msg, vec![control_file(image)], &fuzz_rank())
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!((world, plan.device), (2, 1));
        }
    }

    /// Every committed input of the rank's targets, through the same functions as the fuzzer.
    #[test]
    fn committed_fuzz_inputs_replay() {
        for (target, f) in [
            ("wire", wire as fn(&[u8])),
            ("safetensors", safetensors),
            ("model_config", model_config),
        ] {
            let n = replay(&fuzz_dir(), target, f);
            assert!(n > 0, "fuzz/corpus/{target}/ is empty or missing");
        }
    }
}
