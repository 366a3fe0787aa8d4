//! CPU twins of the ops that the graph-captured decode step added: the ones that read token
//! ids and positions from device memory (RoPE, attention at per-row positions), the fused
//! ones (residual add + RMSNorm, q|k|v split + norm + RoPE + KV store, SiLU·mul as a matmul
//! prologue) and on-device sampling (per-shard top-k, the sampler). Each is written as the
//! composition of the plain ops it fuses, so the fused GPU kernels have an exact meaning.

use super::super::{CpuBuf, CpuDevice};
use super::attention::{attention as attention_rows, AttnArgs};
use super::elementwise::{add, sigmoid_mul, silu_mul, silu_mul_epilogue};
use super::matmul::matmul as matmul_plain;
use super::norm::rms_norm;
use super::rope::rope as rope_rows;
use super::{f32_ptr, typed_ptr};
use crate::ops::{self, Epilogue, Prologue, TOPK_MAX};
use crate::{DType, Device, KernelError, Result, View};

/// The u32 values of a view (ids, positions, the step state).
pub(crate) fn read_u32(v: &View<'_, CpuBuf>) -> Result<Vec<u32>> {
    let p = typed_ptr::<u32>(v, v.len, "u32 view")?;
    // SAFETY: `typed_ptr` checked v.len u32 elements inside the buffer.
    Ok(unsafe { std::slice::from_raw_parts(p.get(), v.len) }.to_vec())
}

pub(crate) fn read_f32(v: &View<'_, CpuBuf>) -> Result<Vec<f32>> {
    let p = f32_ptr(v, v.len, "f32 view")?;
    // SAFETY: `f32_ptr` checked v.len f32 elements inside the buffer.
    Ok(unsafe { std::slice::from_raw_parts(p.get(), v.len) }.to_vec())
}

fn write_u32(v: &View<'_, CpuBuf>, i: usize, value: u32) -> Result<()> {
    let p = typed_ptr::<u32>(v, v.len, "u32 view")?;
    if i >= v.len {
        return Err(KernelError::Invalid(format!("u32 index {i} of {}", v.len)));
    }
    // SAFETY: i < v.len, checked; the buffer is this process's.
    unsafe { *p.get().add(i) = value };
    Ok(())
}

pub(crate) fn write_f32(v: &View<'_, CpuBuf>, vals: &[f32]) -> Result<()> {
    let p = f32_ptr(v, vals.len(), "f32 view")?;
    // SAFETY: checked for vals.len() elements.
    unsafe { std::ptr::copy_nonoverlapping(vals.as_ptr(), p.get(), vals.len()) };
    Ok(())
}

/// Runs of consecutive positions: (first row, rows, first position). A prefill chunk is one
/// run, so the row ops below make one call per chunk.
fn runs(pos: &[u32]) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for (r, &p) in pos.iter().enumerate() {
        match out.last_mut() {
            Some((_, n, p0)) if *p0 + *n == p as usize => *n += 1,
            _ => out.push((r, 1, p as usize)),
        }
    }
    out
}

pub(crate) fn add_rms_norm(dev: &CpuDevice, a: &ops::AddRmsNorm<'_, CpuBuf>) -> Result<()> {
    add(dev, &a.x, &a.delta, &a.x)?;
    rms_norm(dev, &a.x, &a.w, &a.out, a.rows, a.dim, a.eps)
}

pub(crate) fn rope(dev: &CpuDevice, a: &ops::Rope<'_, CpuBuf>) -> Result<()> {
    let row = a.heads * a.head_dim;
    for (r0, n, p0) in runs(&read_u32(&a.pos)?) {
        let x = a.x.slice(r0 * row, n * row);
        rope_rows(
            dev,
            &x,
            &a.inv_freq,
            n,
            a.heads,
            (a.head_dim, a.head_dim),
            p0,
        )?;
    }
    Ok(())
}

/// Each row's cache slot (0 for all without slots), clamped as ops::CacheSlots says.
fn slot_ids(slots: &Option<ops::CacheSlots<'_, CpuBuf>>, rows: usize) -> Result<Vec<usize>> {
    Ok(match slots {
        None => vec![0; rows],
        Some(s) => read_u32(&s.ids)?
            .into_iter()
            .map(|i| (i as usize).min(s.count - 1))
            .collect(),
    })
}

pub(crate) fn qkv_rope(dev: &CpuDevice, a: &ops::QkvRope<'_, CpuBuf>) -> Result<()> {
    let d = a.head_dim;
    let (nq, nkv) = (a.heads * d, a.kv_heads * d);
    let w = nq + 2 * nkv;
    let pos = read_u32(&a.pos)?;
    let cap = a.cap();
    let slot = slot_ids(&a.slots, a.rows)?;
    let qkv = read_f32(&a.qkv)?;
    // Scratch for one row's k and v, so that norm and RoPE run as the plain ops do.
    let kbuf = dev.alloc(2 * nkv * 4)?;
    let (kv, vv) = (
        View::new(&kbuf, 0, nkv, DType::F32),
        View::new(&kbuf, nkv * 4, nkv, DType::F32),
    );
    for (r, &p) in pos.iter().enumerate() {
        let row = &qkv[r * w..(r + 1) * w];
        let q = a.q.slice(r * nq, nq);
        write_f32(&q, &row[..nq])?;
        write_f32(&kv, &row[nq..nq + nkv])?;
        write_f32(&vv, &row[nq + nkv..])?;
        if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
            rms_norm(dev, &q, qn, &q, a.heads, d, a.eps)?;
            rms_norm(dev, &kv, kn, &kv, a.kv_heads, d, a.eps)?;
        }
        let dims = (d, a.rotary_dim);
        rope_rows(dev, &q, &a.inv_freq, 1, a.heads, dims, p as usize)?;
        rope_rows(dev, &kv, &a.inv_freq, 1, a.kv_heads, dims, p as usize)?;
        if (p as usize) < cap {
            let at = (slot[r] * cap + p as usize) * nkv;
            super::super::reduce::copy(dev, &kv, &a.k_cache.slice(at, nkv))?;
            super::super::reduce::copy(dev, &vv, &a.v_cache.slice(at, nkv))?;
        }
    }
    Ok(())
}

pub(crate) fn attention(dev: &CpuDevice, a: &ops::Attention<'_, CpuBuf>) -> Result<()> {
    let (row, kvrow) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
    let cap = a.cap();
    // Positions past the cache are clamped (ops::Attention).
    let pos: Vec<u32> = read_u32(&a.pos)?
        .into_iter()
        .map(|p| p.min(cap as u32 - 1))
        .collect();
    let slot = slot_ids(&a.slots, a.rows)?;
    // Runs of consecutive positions in one slot.
    let mut groups: Vec<(usize, usize, usize)> = Vec::new();
    for (r0, n, p0) in runs(&pos) {
        for r in r0..r0 + n {
            match groups.last_mut() {
                Some((g0, gn, _)) if r > r0 && slot[*g0] == slot[r] => *gn += 1,
                _ => groups.push((r, 1, p0 + r - r0)),
            }
        }
    }
    for (r0, n, p0) in groups {
        let seq = p0 + n;
        let (q, out) = (a.q.slice(r0 * row, n * row), a.out.slice(r0 * row, n * row));
        let base = slot[r0] * cap * kvrow;
        let (k, v) = (
            a.k_cache.slice(base, seq * kvrow),
            a.v_cache.slice(base, seq * kvrow),
        );
        attention_rows(
            dev,
            AttnArgs {
                q: &q,
                k_cache: &k,
                v_cache: &v,
                out: &out,
                rows: n,
                heads: a.heads,
                kv_heads: a.kv_heads,
                head_dim: a.head_dim,
                pos0: p0,
                scale: a.scale,
            },
        )?;
    }
    // The output gate: the SigmoidMul op on the result, as the GPU kernels apply it.
    match &a.gate {
        Some(g) => sigmoid_mul(dev, &a.out, g, &a.out),
        None => Ok(()),
    }
}

pub(crate) fn matmul(dev: &CpuDevice, a: &ops::Matmul<'_, CpuBuf>) -> Result<()> {
    if a.epilogue == Epilogue::SiluMul {
        return silu_mul_epilogue(dev, a.m, a.n, &a.y, |full| {
            let plain = ops::Matmul {
                y: full,
                epilogue: Epilogue::None,
                ..*a
            };
            matmul(dev, &plain)
        });
    }
    match a.prologue {
        Prologue::None => matmul_plain(dev, &a.x, &a.w, a.bias.as_ref(), &a.y, a.m, a.k, a.n),
        Prologue::SiluMul => {
            // act[r] = silu(x[r, ..k]) · x[r, k..], then the plain product.
            let act = dev.alloc(a.m * a.k * 4)?;
            for r in 0..a.m {
                let row = a.x.slice(r * 2 * a.k, 2 * a.k);
                let out = View::new(&act, r * a.k * 4, a.k, DType::F32);
                silu_mul(dev, &row.slice(0, a.k), &row.slice(a.k, a.k), &out)?;
            }
            let x = View::new(&act, 0, a.m * a.k, DType::F32);
            matmul_plain(dev, &x, &a.w, a.bias.as_ref(), &a.y, a.m, a.k, a.n)
        }
    }
}

/// AddRmsNorm on a copy of `x` (`x` itself is an input here), then the plain product.
pub(crate) fn add_norm_matmul(dev: &CpuDevice, a: &ops::AddNormMatmul<'_, CpuBuf>) -> Result<()> {
    let mk = a.m * a.k;
    let (sum, normed) = (dev.alloc(mk * 4)?, dev.alloc(mk * 4)?);
    let (sum, normed) = (
        View::new(&sum, 0, mk, DType::F32),
        View::new(&normed, 0, mk, DType::F32),
    );
    write_f32(&sum, &read_f32(&a.x)?)?;
    add_rms_norm(
        dev,
        &ops::AddRmsNorm {
            x: sum,
            delta: a.delta,
            w: a.norm_w,
            out: normed,
            rows: a.m,
            dim: a.k,
            eps: a.eps,
        },
    )?;
    if let Some(out) = &a.x_out {
        write_f32(out, &read_f32(&sum)?)?;
    }
    matmul_plain(dev, &normed, &a.w, a.bias.as_ref(), &a.y, a.m, a.k, a.n)
}

/// (logit, id) ordered best first: larger logit, then lower id.
fn better(a: (f32, u32), b: (f32, u32)) -> bool {
    a.0 > b.0 || (a.0 == b.0 && a.1 < b.1)
}

pub(crate) fn shard_topk(a: &ops::ShardTopK<'_, CpuBuf>) -> Result<()> {
    let logits = read_f32(&a.logits)?;
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(a.k + 1);
    let mut finite = true;
    for (i, &l) in logits.iter().enumerate() {
        finite &= l.is_finite();
        if l.is_nan() {
            continue;
        }
        let c = (l, (a.vocab_start + i) as u32);
        if best.len() == a.k && !better(c, best[a.k - 1]) {
            continue;
        }
        let at = best
            .iter()
            .position(|&b| better(c, b))
            .unwrap_or(best.len());
        best.insert(at, c);
        best.truncate(a.k);
    }
    let mut out = vec![0f32; 2 * a.k];
    for i in 0..a.k {
        let (l, id) = best.get(i).copied().unwrap_or((f32::NEG_INFINITY, 0));
        out[2 * i] = l;
        out[2 * i + 1] = id as f32;
    }
    if !finite {
        // The row is not finite: mark it for Sample (ops::ShardTopK).
        out[0] = f32::from_bits(ops::NAN_BITS);
    }
    write_f32(&a.out, &out)
}

/// The token [`ops::Sample`] picks from candidate pairs, written once for the CPU backend and
/// mirrored line by line by the GPU kernel (sample.cu).
pub fn pick(cands: &[f32], p: &ops::SampleParams, position: u32) -> u32 {
    // A NaN logit: some shard's row was not finite (ops::ShardTopK); no token to pick.
    if cands.chunks_exact(2).any(|pair| pair[0].is_nan()) {
        return ops::NO_TOKEN;
    }
    // Valid candidates (padding dropped), best first.
    let mut c: Vec<(f32, u32)> = cands
        .chunks_exact(2)
        .filter(|pair| pair[0] > f32::NEG_INFINITY)
        .map(|pair| (pair[0], pair[1] as u32))
        .collect();
    if c.is_empty() {
        return 0;
    }
    c.sort_by(|&a, &b| {
        if better(a, b) {
            std::cmp::Ordering::Less
        } else if better(b, a) {
            std::cmp::Ordering::Greater
        } else {
            std::cmp::Ordering::Equal
        }
    });
    if p.temperature <= 0.0 || p.top_k == 1 {
        return c[0].1;
    }
    let k = match p.top_k {
        0 => TOPK_MAX,
        k => (k as usize).min(TOPK_MAX),
    }
    .min(c.len());
    // Unnormalised probabilities relative to the best, summed in order in f32.
    let mut w = [0f32; TOPK_MAX];
    let mut total = 0f32;
    for i in 0..k {
        w[i] = ((c[i].0 - c[0].0) / p.temperature).exp();
        total += w[i];
    }
    // Nucleus: the shortest prefix whose share reaches top_p (at least one).
    let mut kept = 0;
    let mut mass = 0f32;
    while kept < k {
        mass += w[kept];
        kept += 1;
        if mass >= p.top_p * total {
            break;
        }
    }
    let r = ops::sample_uniform(p.seed, position) * mass;
    let mut acc = 0f32;
    for (i, &wi) in w.iter().enumerate().take(kept) {
        acc += wi;
        if r < acc {
            return c[i].1;
        }
    }
    c[kept - 1].1
}

pub(crate) fn sample(a: &ops::Sample<'_, CpuBuf>) -> Result<()> {
    let cands = read_f32(&a.cands)?;
    let state = read_u32(&a.state)?;
    let next = state[1].wrapping_add(1);
    let t = pick(&cands, &a.params, next);
    write_u32(&a.state, 0, t)?;
    write_u32(&a.state, 1, next)?;
    if (next as usize) < a.tokens.len {
        write_u32(&a.tokens, next as usize, t)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::ops::SampleParams;
    use crate::Op;

    fn u32buf(dev: &CpuDevice, v: &[u32]) -> CpuBuf {
        let b = dev.alloc(v.len() * 4).unwrap();
        dev.write(&b, 0, &crate::dtype::encode_u32(v)).unwrap();
        b
    }

    /// Each of `world` shards' `k` best (logit, id) pairs of `logits`, back to back (rank r's
    /// at 2k·r), as the model gathers them.
    fn shard_topk_all(dev: &CpuDevice, logits: &[f32], world: usize, k: usize) -> CpuBuf {
        let cands = dev.alloc(world * 2 * k * 4).unwrap();
        for r in 0..world {
            let sh = crate::comm::shard_range(logits.len(), world, r);
            let lb = upload(dev, DType::F32, &logits[sh.clone()]);
            dev.run(&Op::ShardTopK(ops::ShardTopK {
                logits: View::new(&lb, 0, sh.len(), DType::F32),
                vocab_start: sh.start,
                k,
                out: View::new(&cands, r * 2 * k * 4, 2 * k, DType::F32),
            }))
            .unwrap();
        }
        cands
    }

    /// AddNormMatmul against an f64 reference on random data with poisoned outputs: y, and
    /// x_out = x + delta.
    #[test]
    fn add_norm_matmul_matches_f64() {
        let dev = CpuDevice::new(0, 2, 0);
        let mut rng = Rng::new(0x616e_6d6d);
        let (m, k, n, eps) = (3usize, 67usize, 29usize, 1e-5f32);
        let mut draw = |len: usize| rng.vec_sym(len);
        let (x, d, g) = (draw(m * k), draw(m * k), draw(k));
        let w = rounded(DType::BF16, &draw(n * k));
        let bias = draw(n);
        let f32v = |b, len| View::new(b, 0, len, DType::F32);
        let (xb, db, gb) = (
            upload(&dev, DType::F32, &x),
            upload(&dev, DType::F32, &d),
            upload(&dev, DType::F32, &g),
        );
        let (wb, bb) = (
            upload(&dev, DType::BF16, &w),
            upload(&dev, DType::F32, &bias),
        );
        let yb = upload(&dev, DType::F32, &vec![f32::NAN; m * n]);
        let ob = upload(&dev, DType::F32, &vec![f32::NAN; m * k]);
        dev.run(&Op::AddNormMatmul(ops::AddNormMatmul {
            x: f32v(&xb, m * k),
            delta: f32v(&db, m * k),
            norm_w: f32v(&gb, k),
            x_out: Some(f32v(&ob, m * k)),
            eps,
            w: View::new(&wb, 0, n * k, DType::BF16),
            bias: Some(f32v(&bb, n)),
            y: f32v(&yb, m * n),
            m,
            k,
            n,
        }))
        .unwrap();
        let (mut want_y, mut want_s) = (Vec::new(), Vec::new());
        for r in 0..m {
            let s: Vec<f64> = (0..k)
                .map(|i| x[r * k + i] as f64 + d[r * k + i] as f64)
                .collect();
            let rs = 1.0 / (s.iter().map(|v| v * v).sum::<f64>() / k as f64 + eps as f64).sqrt();
            for o in 0..n {
                let dot: f64 = (0..k)
                    .map(|i| s[i] * rs * g[i] as f64 * w[o * k + i] as f64)
                    .sum();
                want_y.push(dot + bias[o] as f64);
            }
            want_s.extend(s);
        }
        assert!(max_err(&download(&dev, &yb, DType::F32, m * n), &want_y) < 1e-5);
        assert!(max_err(&download(&dev, &ob, DType::F32, m * k), &want_s) < 1e-6);
    }

    /// The CPU's QkvMatmul runs its product and QkvRope apart (the GPU's fused kernel is
    /// checked against it by `selftest` and scripts/emulate_gemv_rope.sh): the same bits as
    /// the two ops through `Device::run`, with and without the seam, the cache row written;
    /// and validate() refuses what the fused kernel cannot do (a q/k norm, partial RoPE).
    #[test]
    fn qkv_matmul_is_the_product_then_qkv_rope() {
        const HEADS: usize = 3;
        const KVH: usize = 1;
        const D: usize = 8;
        const K: usize = 40;
        const CAP: usize = 6;
        const N: usize = (HEADS + 2 * KVH) * D;
        fn f32v(b: &CpuBuf, len: usize) -> View<'_, CpuBuf> {
            View::new(b, 0, len, DType::F32)
        }
        /// x, delta, norm_w, w, bias, inv_freq, pos; then the outputs: qkv scratch, q,
        /// k_cache, v_cache, x_out.
        fn op(b: &[CpuBuf], seam: bool) -> ops::QkvMatmul<'_, CpuBuf> {
            ops::QkvMatmul {
                x: f32v(&b[0], K),
                seam: seam.then(|| ops::Seam {
                    delta: f32v(&b[1], K),
                    norm_w: f32v(&b[2], K),
                    x_out: Some(f32v(&b[11], K)),
                    eps: 1e-5,
                }),
                w: View::new(&b[3], 0, N * K, DType::BF16),
                bias: Some(f32v(&b[4], N)),
                k: K,
                rope: ops::QkvRope {
                    qkv: f32v(&b[7], N),
                    q: f32v(&b[8], HEADS * D),
                    k_cache: f32v(&b[9], CAP * KVH * D),
                    v_cache: f32v(&b[10], CAP * KVH * D),
                    pos: View::new(&b[6], 0, 1, DType::U32),
                    slots: None,
                    inv_freq: f32v(&b[5], D / 2),
                    q_norm: None,
                    k_norm: None,
                    eps: 0.0,
                    rows: 1,
                    heads: HEADS,
                    kv_heads: KVH,
                    head_dim: D,
                    rotary_dim: D,
                },
            }
        }
        let dev = CpuDevice::new(0, 1, 10);
        let mut rng = Rng::new(0x716b_766d);
        let (x, dl) = (rng.vec_sym(K), rng.vec_sym(K));
        let inv: Vec<f32> = (0..D / 2).map(|i| 1.0 / (i as f32 + 1.0)).collect();
        let bufs = |rng: &mut Rng| -> Vec<CpuBuf> {
            let mut b = vec![
                upload(&dev, DType::F32, &x),
                upload(&dev, DType::F32, &dl),
                upload(&dev, DType::F32, &rng.vec_sym(K)),
                upload(&dev, DType::BF16, &rng.vec_sym(N * K)),
                upload(&dev, DType::F32, &rng.vec_sym(N)),
                upload(&dev, DType::F32, &inv),
                u32buf(&dev, &[4]),
            ];
            for len in [N, HEADS * D, CAP * KVH * D, CAP * KVH * D, K] {
                b.push(upload(&dev, DType::F32, &vec![f32::NAN; len]));
            }
            b
        };
        for seam in [false, true] {
            let fused = bufs(&mut Rng::new(7));
            let apart = bufs(&mut Rng::new(7));
            dev.run(&Op::QkvMatmul(op(&fused, seam))).unwrap();
            let two = op(&apart, seam);
            dev.run(&two.product()).unwrap();
            dev.run(&Op::QkvRope(two.rope)).unwrap();
            let bits = |b: &CpuBuf, len| -> Vec<u32> {
                download(&dev, b, DType::F32, len)
                    .iter()
                    .map(|f| f.to_bits())
                    .collect()
            };
            for (i, len) in [(8, HEADS * D), (9, CAP * KVH * D), (10, CAP * KVH * D)] {
                assert_eq!(bits(&fused[i], len), bits(&apart[i], len), "{i} {seam}");
            }
            let keys = download(&dev, &fused[9], DType::F32, CAP * KVH * D);
            assert!(keys[4 * KVH * D..5 * KVH * D].iter().all(|v| v.is_finite()));
            if seam {
                let xo = download(&dev, &fused[11], DType::F32, K);
                assert!(xo
                    .iter()
                    .zip(x.iter().zip(&dl))
                    .all(|(o, (a, b))| *o == a + b));
            }
            // What the fused kernel cannot do is refused.
            let mut bad = op(&fused, seam);
            bad.rope.rotary_dim = D / 2;
            bad.rope.inv_freq = f32v(&fused[5], D / 4);
            assert!(dev.run(&Op::QkvMatmul(bad)).is_err());
            let mut bad = op(&fused, seam);
            bad.rope.q_norm = Some(f32v(&fused[2], D));
            bad.rope.k_norm = Some(f32v(&fused[2], D));
            assert!(dev.run(&Op::QkvMatmul(bad)).is_err());
        }
    }

    #[test]
    fn topk_then_greedy_sample_is_the_argmax_of_all_shards() {
        let dev = CpuDevice::new(0, 2, 10);
        let mut rng = Rng::new(5);
        let vocab = 1000;
        let mut logits = rng.vec_sym(vocab);
        logits[700] = 3.0;
        logits[701] = 3.0; // a tie: the lower id wins
        let world = 3;
        let k = 4;
        let cands = shard_topk_all(&dev, &logits, world, k);
        let state = u32buf(&dev, &[9, 4]);
        let tokens = u32buf(&dev, &[0; 8]);
        let p = SampleParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 1,
        };
        dev.run(&Op::Sample(ops::Sample {
            cands: View::new(&cands, 0, world * 2 * k, DType::F32),
            params: p,
            state: View::new(&state, 0, 2, DType::U32),
            tokens: View::new(&tokens, 0, 8, DType::U32),
        }))
        .unwrap();
        let st = read_u32(&View::new(&state, 0, 2, DType::U32)).unwrap();
        assert_eq!(st, vec![700, 5]);
        let tk = read_u32(&View::new(&tokens, 0, 8, DType::U32)).unwrap();
        assert_eq!(tk[5], 700);
    }

    /// A NaN or infinity anywhere in a shard's logits marks its pair 0 NaN, and Sample then
    /// gives NO_TOKEN: greedy or not, and whichever shard held it.
    #[test]
    fn a_row_that_is_not_finite_gives_no_token() {
        let dev = CpuDevice::new(0, 2, 10);
        let vocab = 100;
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 37, 99] {
                let mut logits: Vec<f32> = (0..vocab).map(|i| (i % 13) as f32 * 0.25).collect();
                logits[at] = bad;
                let world = 2;
                let k = 4;
                let cands = shard_topk_all(&dev, &logits, world, k);
                let pairs = read_f32(&View::new(&cands, 0, world * 2 * k, DType::F32)).unwrap();
                let shard = at / (vocab / world);
                assert_eq!(
                    pairs[shard * 2 * k].to_bits(),
                    ops::NAN_BITS,
                    "{bad} at {at}"
                );
                for t in [0.0, 1.0] {
                    let p = SampleParams {
                        temperature: t,
                        top_k: 0,
                        top_p: 1.0,
                        seed: 1,
                    };
                    assert_eq!(pick(&pairs, &p, 5), ops::NO_TOKEN, "{bad} at {at}, t {t}");
                }
            }
        }
        // Padding alone is no error (an empty shard's pairs): token 0, as before.
        let p = SampleParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 1,
        };
        assert_eq!(pick(&[f32::NEG_INFINITY, 0.0], &p, 1), 0);
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // Two candidates with logits ln 3 and 0 at temperature 1: 3:1.
        let cands = [0.0, 5.0, 3f32.ln(), 2.0, f32::NEG_INFINITY, 0.0];
        let p = SampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 11,
        };
        let n = 4000;
        let twos = (0..n).filter(|&i| pick(&cands, &p, i) == 2).count();
        assert!((twos as f64 / n as f64 - 0.75).abs() < 0.03, "{twos}");
        // top_p 0.5 keeps only the best; top_k 1 too.
        assert!((0..100).all(|i| pick(&cands, &SampleParams { top_p: 0.5, ..p }, i) == 2));
        assert!((0..100).all(|i| pick(&cands, &SampleParams { top_k: 1, ..p }, i) == 2));
    }

    #[test]
    fn qkv_rope_equals_the_ops_it_fuses() {
        let dev = CpuDevice::new(0, 2, 10);
        let mut rng = Rng::new(8);
        let (heads, kvh, d, rows, cap) = (4, 2, 8, 3, 10);
        let w = (heads + 2 * kvh) * d;
        let qkv = rng.vec_sym(rows * w);
        let inv: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / 100f32.powf(2.0 * i as f32 / d as f32))
            .collect();
        let (qkvb, invb) = (
            upload(&dev, DType::F32, &qkv),
            upload(&dev, DType::F32, &inv),
        );
        let posb = u32buf(&dev, &[5, 6, 7]);
        let q = dev.alloc(rows * heads * d * 4).unwrap();
        let (kc, vc) = (
            dev.alloc(cap * kvh * d * 2).unwrap(),
            dev.alloc(cap * kvh * d * 2).unwrap(),
        );
        dev.run(&Op::QkvRope(ops::QkvRope {
            qkv: View::new(&qkvb, 0, rows * w, DType::F32),
            q: View::new(&q, 0, rows * heads * d, DType::F32),
            k_cache: View::new(&kc, 0, cap * kvh * d, DType::BF16),
            v_cache: View::new(&vc, 0, cap * kvh * d, DType::BF16),
            pos: View::new(&posb, 0, rows, DType::U32),
            slots: None,
            inv_freq: View::new(&invb, 0, d / 2, DType::F32),
            q_norm: None,
            k_norm: None,
            eps: 1e-6,
            rows,
            heads,
            kv_heads: kvh,
            head_dim: d,
            rotary_dim: d,
        }))
        .unwrap();
        // The same through the plain ops: v is stored unrotated, k rotated.
        let vals = download(&dev, &vc, DType::BF16, cap * kvh * d);
        for r in 0..rows {
            let want = rounded(DType::BF16, &qkv[r * w + (heads + kvh) * d..(r + 1) * w]);
            let at = (5 + r) * kvh * d;
            assert_eq!(&vals[at..at + kvh * d], &want[..]);
        }
        let kb = upload(
            &dev,
            DType::F32,
            &qkv[2 * w + heads * d..2 * w + (heads + kvh) * d],
        );
        rope_rows(
            &dev,
            &View::new(&kb, 0, kvh * d, DType::F32),
            &View::new(&invb, 0, d / 2, DType::F32),
            1,
            kvh,
            (d, d),
            7,
        )
        .unwrap();
        let want = rounded(DType::BF16, &download(&dev, &kb, DType::F32, kvh * d));
        let keys = download(&dev, &kc, DType::BF16, cap * kvh * d);
        assert_eq!(&keys[7 * kvh * d..8 * kvh * d], &want[..]);
    }

    /// Qwen3.5's partial RoPE: the first rotary_dim dims of each head rotate (i with
    /// i + rotary_dim/2, frequencies over rotary_dim), the rest pass through; against f64.
    #[test]
    fn qkv_rope_rotates_only_the_first_rotary_dims() {
        let dev = CpuDevice::new(0, 1, 10);
        let mut rng = Rng::new(9);
        let (heads, kvh, d, rd, cap) = (2, 1, 16, 4, 8);
        let w = (heads + 2 * kvh) * d;
        let qkv = rng.vec_sym(w);
        let inv: Vec<f32> = (0..rd / 2)
            .map(|i| (1.0 / 1e7f64.powf(2.0 * i as f64 / rd as f64)) as f32)
            .collect();
        let (qkvb, invb, posb) = (
            upload(&dev, DType::F32, &qkv),
            upload(&dev, DType::F32, &inv),
            u32buf(&dev, &[3]),
        );
        let q = dev.alloc(heads * d * 4).unwrap();
        let (kc, vc) = (
            dev.alloc(cap * kvh * d * 4).unwrap(),
            dev.alloc(cap * kvh * d * 4).unwrap(),
        );
        dev.run(&Op::QkvRope(ops::QkvRope {
            qkv: View::new(&qkvb, 0, w, DType::F32),
            q: View::new(&q, 0, heads * d, DType::F32),
            k_cache: View::new(&kc, 0, cap * kvh * d, DType::F32),
            v_cache: View::new(&vc, 0, cap * kvh * d, DType::F32),
            pos: View::new(&posb, 0, 1, DType::U32),
            slots: None,
            inv_freq: View::new(&invb, 0, rd / 2, DType::F32),
            q_norm: None,
            k_norm: None,
            eps: 1e-6,
            rows: 1,
            heads,
            kv_heads: kvh,
            head_dim: d,
            rotary_dim: rd,
        }))
        .unwrap();
        let want = |x: &[f32]| -> Vec<f64> {
            let mut o: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            for i in 0..rd / 2 {
                let a = 3.0 * inv[i] as f64;
                let (x1, x2) = (x[i] as f64, x[i + rd / 2] as f64);
                o[i] = x1 * a.cos() - x2 * a.sin();
                o[i + rd / 2] = x2 * a.cos() + x1 * a.sin();
            }
            o
        };
        let got = download(&dev, &q, DType::F32, heads * d);
        for h in 0..heads {
            let e = max_err(&got[h * d..(h + 1) * d], &want(&qkv[h * d..(h + 1) * d]));
            assert!(e < 1e-6, "head {h}: {e:e}");
            assert_eq!(&got[h * d + rd..(h + 1) * d], &qkv[h * d + rd..(h + 1) * d]);
        }
        let keys = download(&dev, &kc, DType::F32, cap * kvh * d);
        let k = &qkv[heads * d..(heads + 1) * d];
        assert!(max_err(&keys[3 * d..4 * d], &want(k)) < 1e-6);
    }
}
