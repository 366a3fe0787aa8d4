//! The model shard's public API used the way the coordinator uses it: synth a model folder,
//! tokenize on the coordinator side, load one shard per rank, run the shared decode loop on
//! every rank, stream the text from rank 0. Ranks are threads here; the multi-process path
//! is the coordinator's test.

use std::sync::Arc;

use tprun_kernels::cpu::CpuDevice;
use tprun_kernels::DType;
use tprun_rank::model::{
    generate, synth, Arch, GenerateOptions, LoadOptions, LocalComm, Model, ModelConfig, Preset,
    SamplerConfig, SynthOptions, TextStream, Tokenizer,
};

#[test]
fn synth_tokenize_load_generate_stream() {
    let dir = std::env::temp_dir().join(format!("tprun-decode-api-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let opts = SynthOptions {
        arch: Arch::parse("qwen3").unwrap(),
        preset: Preset::parse("tiny").unwrap(),
        dtype: DType::BF16,
        seed: 3,
        tie_embeddings: None,
    };
    let mut last = (0, 0);
    let cfg = synth(&dir, &opts, &mut |done, total| last = (done, total)).unwrap();
    assert_eq!(last.0, last.1);
    assert_eq!(ModelConfig::from_dir(&dir).unwrap(), cfg);

    // Coordinator side: tokenizer and stop ids.
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let prompt = tok.encode("Hello").unwrap();
    let stop = cfg.eos.clone();

    // Rank side, 2 ranks: load, then the same loop with the same seed on every rank.
    let world = 2;
    let devs: Vec<Arc<CpuDevice>> = (0..world)
        .map(|r| Arc::new(CpuDevice::new(r, 1, 50)))
        .collect();
    let comms = LocalComm::world(&devs, 64 << 10).unwrap();
    let outs: Vec<Vec<u32>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, mut comm)| {
                let (dev, dir, prompt, stop) = (devs[rank].clone(), &dir, &prompt, &stop);
                s.spawn(move || {
                    let mut model =
                        Model::load(dev, dir, rank, world, &LoadOptions::default()).unwrap();
                    assert!(model.max_allreduce_bytes() >= cfg_bytes(model.config()));
                    let sampler = SamplerConfig {
                        temperature: 0.8,
                        top_k: 40,
                        top_p: 0.95,
                        seed: 1234,
                    };
                    let g = GenerateOptions {
                        max_new_tokens: 16,
                        stop: stop.clone(),
                    };
                    let mut ids = Vec::new();
                    let st = generate(&mut model, &mut comm, &sampler, prompt, &g, &mut |t| {
                        ids.push(t);
                        Ok(true)
                    })
                    .unwrap();
                    assert_eq!(st.generated, ids.len());
                    ids
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Sampling with temperature: still the same tokens on every rank.
    assert_eq!(outs[0], outs[1]);
    assert!(!outs[0].is_empty());

    let mut stream = TextStream::new();
    let mut text = String::new();
    for &t in &outs[0] {
        text.extend(stream.push(&tok, t).unwrap());
    }
    assert!(tok.decode(&outs[0]).unwrap().starts_with(&text));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn cfg_bytes(c: &ModelConfig) -> usize {
    c.vocab * 4
}
