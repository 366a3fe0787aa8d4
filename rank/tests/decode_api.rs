//! The model shard's public API used the way the coordinator uses it: synth a model folder,
//! take the prompt's ids (the coordinator tokenizes; here the synthetic tokenizer's ids stand
//! in), load one shard per rank, run the shared decode loop on every rank. Ranks are threads
//! here; the multi-process path and the text streaming are the coordinator's tests.

use std::sync::Arc;

use tprun_kernels::cpu::CpuDevice;
use tprun_kernels::DType;
use tprun_rank::model::{
    generate, synth, Arch, GenerateOptions, LoadOptions, LocalComm, Model, ModelConfig, Preset,
    SamplerConfig, SynthOptions,
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
        quant: None,
    };
    let mut last = (0, 0);
    let cfg = synth(&dir, &opts, &mut |done, total| last = (done, total)).unwrap();
    assert_eq!(last.0, last.1);
    assert_eq!(ModelConfig::from_dir(&dir).unwrap(), cfg);

    // Coordinator side: the prompt's ids and the stop ids.
    let prompt = synth::synth_ids("Hello");
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
    // Every id is one the synthetic vocabulary has.
    assert!(outs[0].iter().all(|&t| (t as usize) < cfg.vocab));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn cfg_bytes(c: &ModelConfig) -> usize {
    c.vocab * 4
}
