//! `decode` on one rank: load this rank's shard, establish the communicator, run the shared
//! generation loop. Rank 0 publishes each token into the control block's token ring (the
//! coordinator streams the text) and reports the statistics at the end.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tprun_ipc::{Conn, Msg};
use tprun_kernels::Device;

use crate::comm::Communicator;
use crate::job::{self, Backend, DecodeSpec, ModelSource, ModelSpec, Report};
use crate::model::safetensors::Checkpoint;
use crate::model::{
    generate, synth, GenerateOptions, LoadOptions, Model, ModelConfig, SamplerConfig,
};
use crate::run::RankCtx;
use crate::{Phase, RankError};

#[allow(clippy::too_many_arguments)]
pub fn run<D: Device>(
    ctx: &RankCtx,
    conn: &Conn,
    dev: Arc<D>,
    backend: Backend,
    spec: &DecodeSpec,
    timeout: Duration,
    spin: u32,
) -> Result<(), RankError> {
    let profiled = dev.clone();
    let (mut model, mut comm) = start(ctx, conn, dev, backend, &spec.model, 1, timeout, spin)?;
    // Measurement only (wrong tokens at world > 1): the step without its allreduces.
    model.set_no_allreduce(spec.no_allreduce);
    // Profiling times each op, so the steps are launched one by one.
    model.set_graph(spec.model.graph && !spec.profile);
    ctx.enter(Phase::Prefill);
    let sampler = SamplerConfig {
        temperature: spec.temperature,
        top_k: spec.top_k,
        top_p: spec.top_p,
        seed: spec.seed,
    };
    let gen = GenerateOptions {
        max_new_tokens: spec.max_new_tokens,
        stop: spec.stop.clone(),
    };
    // One record per token the KV cache leaves room for: never more than `max_new_tokens`,
    // which need not be bounded by anything else.
    let mut steps = Vec::with_capacity(gen.budget(model.max_seq(), spec.prompt.len()));
    let mut last: Option<Instant> = None;
    let control = ctx.control.clone();
    let rank = ctx.rank;
    let mut publish = |id: u32| -> Result<bool, RankError> {
        let now = Instant::now();
        match last {
            None => {
                // The first token is the prefill's: the profile covers the steps after it.
                if spec.profile {
                    profiled.set_profiling(true);
                }
                ctx.enter(Phase::Decode)
            }
            Some(t) => steps.push((now - t).as_secs_f32() * 1e6),
        }
        last = Some(now);
        if rank == 0 {
            control.push_token(0, id, timeout)?;
        }
        control.beat(rank);
        Ok(true)
    };
    let stats = match &spec.dump_logits {
        None => generate(
            &mut model,
            &mut comm,
            &sampler,
            &spec.prompt,
            &gen,
            &mut publish,
        )?,
        Some(path) => dump_logits(
            &mut model,
            &mut comm,
            &spec.prompt,
            &gen,
            path,
            rank,
            &mut publish,
        )?,
    };
    comm.close()?;
    let profile = if spec.profile {
        let p = profiled.profile()?;
        profiled.set_profiling(false);
        p.into_iter()
            .map(|t| (t.label, t.calls, t.seconds))
            .collect()
    } else {
        Vec::new()
    };
    if ctx.rank == 0 {
        report(
            conn,
            &Report::Decode {
                prompt_tokens: stats.prompt_tokens,
                generated: stats.generated,
                stopped: stats.stopped,
                prefill_s: stats.prefill.as_secs_f64(),
                decode_s: stats.decode.as_secs_f64(),
                step_us: steps,
                step_bytes: model.step_bytes(),
                graph: stats.graph,
                allreduces_per_step: stats.allreduces_per_step,
                launches_per_step: stats.launches_per_step,
                profile,
            },
        )?;
    }
    Ok(())
}

/// The start of a decode or serve job: this rank's shard of the model loaded ([`load`], with
/// `slots` sequences' KV cache; graphs as the spec says), then the communicator established
/// with room for the model's largest allreduce.
#[allow(clippy::too_many_arguments)]
pub(crate) fn start<D: Device>(
    ctx: &RankCtx,
    conn: &Conn,
    dev: Arc<D>,
    backend: Backend,
    spec: &ModelSpec,
    slots: usize,
    timeout: Duration,
    spin: u32,
) -> Result<(Model<D>, Communicator<D>), RankError> {
    let mut model = load(
        ctx,
        conn,
        dev.clone(),
        &spec.source,
        &spec.load_options(slots),
    )?;
    model.set_graph(spec.graph);
    let comm = Communicator::establish(
        dev,
        conn,
        ctx,
        backend,
        model.max_allreduce_bytes(),
        timeout,
        spin,
    )?;
    Ok((model, comm))
}

/// Loads this rank's shard of `source` (rank 0 reports the progress and, at the end, what it
/// loaded): the first phase of a decode or serve job.
pub(crate) fn load<D: Device>(
    ctx: &RankCtx,
    conn: &Conn,
    dev: Arc<D>,
    source: &ModelSource,
    opts: &LoadOptions,
) -> Result<Model<D>, RankError> {
    ctx.enter(Phase::Loading);
    let t0 = Instant::now();
    // Loading a large shard is disk-bound and may outlast --timeout; it beats on its own
    // thread meanwhile so that the coordinator does not take it for a stall. Rank 0 reports
    // its bytes (at most every 1/8 s: the coordinator only draws a bar).
    let mut last = Instant::now();
    let model = ctx.beating(|| -> Result<Model<D>, RankError> {
        let (cfg, ck) = match source {
            ModelSource::Dir(dir) => (
                ModelConfig::from_dir(Path::new(dir))?,
                Checkpoint::open(Path::new(dir))?,
            ),
            ModelSource::Synthetic(opts) => synth::in_memory(opts)?,
        };
        Ok(Model::load_checkpoint(
            dev.clone(),
            &ck,
            cfg,
            ctx.rank,
            ctx.world,
            opts,
            &mut |done, total| {
                if ctx.rank == 0 && (last.elapsed() >= Duration::from_millis(125) || done == total)
                {
                    last = Instant::now();
                    let _ = report(conn, &Report::LoadProgress { done, total });
                }
            },
        )?)
    })?;
    if ctx.rank == 0 {
        report(
            conn,
            &Report::Loaded {
                seconds: t0.elapsed().as_secs_f64(),
                bytes: model.load_bytes(),
                device_bytes: model.device_bytes(),
            },
        )?;
    }
    Ok(model)
}

/// Greedy generation one step at a time through [`Model::prefill`] and [`Model::step`], with
/// every step's full-vocab logits appended to `path` by rank 0 (f32 little endian): the
/// reference-comparison mode. Slower than [`generate`] (a host round trip per token).
#[allow(clippy::too_many_arguments)]
fn dump_logits<D: Device>(
    model: &mut Model<D>,
    comm: &mut Communicator<D>,
    prompt: &[u32],
    gen: &GenerateOptions,
    path: &str,
    rank: usize,
    on_token: &mut dyn FnMut(u32) -> Result<bool, RankError>,
) -> Result<crate::model::GenerateStats, RankError> {
    use std::io::Write;
    let mut out = if rank == 0 {
        Some(std::io::BufWriter::new(
            std::fs::File::create(path)
                .map_err(|e| RankError::Other(format!("creating {path}: {e}")))?,
        ))
    } else {
        None
    };
    let mut st = crate::model::GenerateStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut logits = model.prefill(comm, prompt)?.to_vec();
    st.prefill = t0.elapsed();
    let t1 = Instant::now();
    let budget = gen.budget(model.max_seq(), prompt.len());
    let mut pos = prompt.len();
    while st.generated < budget {
        // The full row is on the host here anyway: check it all.
        if logits.iter().any(|l| !l.is_finite()) {
            return Err(crate::model::forward::not_finite(st.generated + 1, pos));
        }
        if let Some(o) = &mut out {
            let bytes: Vec<u8> = logits.iter().flat_map(|l| l.to_le_bytes()).collect();
            o.write_all(&bytes)
                .map_err(|e| RankError::Other(format!("writing {path}: {e}")))?;
        }
        let next = crate::model::sample::argmax(&logits);
        if gen.stop.contains(&next) {
            st.stopped = true;
            break;
        }
        st.generated += 1;
        if !on_token(next)? || st.generated == budget {
            break;
        }
        logits = model.step(comm, next, pos)?.to_vec();
        pos += 1;
    }
    if let Some(o) = &mut out {
        o.flush()
            .map_err(|e| RankError::Other(format!("writing {path}: {e}")))?;
    }
    st.decode = t1.elapsed();
    Ok(st)
}

pub(crate) fn report(conn: &Conn, r: &Report) -> Result<(), RankError> {
    conn.send(
        &Msg::Report {
            payload: job::encode(r),
        },
        &[],
    )?;
    Ok(())
}
