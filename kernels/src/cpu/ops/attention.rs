//! `Attention`: causal grouped-query attention of a block of query positions over the KV
//! cache, with f32 scores and softmax (as transformers' eager attention in f32).

use super::super::{par_ranges, CpuBuf, CpuDevice};
use super::{dot, f32_ptr, typed_ptr, widen, MIN_WORK_PER_THREAD};
use crate::dtype::Elem;
use crate::{with_dtype, DType, KernelError, Result, View};

pub(crate) struct AttnArgs<'v, 'a> {
    pub q: &'v View<'a, CpuBuf>,
    pub k_cache: &'v View<'a, CpuBuf>,
    pub v_cache: &'v View<'a, CpuBuf>,
    pub out: &'v View<'a, CpuBuf>,
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub pos0: usize,
    pub scale: f32,
}

pub(crate) fn attention(dev: &CpuDevice, a: AttnArgs<'_, '_>) -> Result<()> {
    let (rows, heads, kvh, hd) = (a.rows, a.heads, a.kv_heads, a.head_dim);
    if kvh == 0 || hd == 0 || !heads.is_multiple_of(kvh) {
        return Err(KernelError::Invalid(format!(
            "attention: {heads} query heads over {kvh} kv heads of {hd}"
        )));
    }
    if a.k_cache.dtype != a.v_cache.dtype {
        return Err(KernelError::Invalid(
            "attention: k and v caches differ in dtype".into(),
        ));
    }
    let group = heads / kvh;
    let seq = a.pos0 + rows;
    let kv_row = kvh * hd;
    let q = f32_ptr(a.q, rows * heads * hd, "attention q")?;
    let o = f32_ptr(a.out, rows * heads * hd, "attention out")?;
    let (pos0, scale) = (a.pos0, a.scale);
    with_dtype!(a.k_cache.dtype, T => {
        let k = typed_ptr::<T>(a.k_cache, seq * kv_row, "attention k_cache")?;
        let v = typed_ptr::<T>(a.v_cache, seq * kv_row, "attention v_cache")?;
        // One work item per (query row, head); later rows see more keys, so items interleave
        // poorly only at the edges of a range.
        par_ranges(dev.threads(), rows * heads, (MIN_WORK_PER_THREAD / (seq * hd)).max(1), |r| {
            let mut scores = vec![0f32; seq];
            let mut acc = vec![0f32; hd];
            let mut krow = vec![0f32; hd];
            for item in r {
                let (row, h) = (item / heads, item % heads);
                let kh = h / group;
                let len = pos0 + row + 1;
                // SAFETY: every index below is < seq·kv_row (caches) or rows·heads·hd (q,
                // out), all checked above; `out` overlaps nothing else (Attention::validate(),
                // which Device::launch requires) and this item's head row is written by this
                // thread only.
                unsafe {
                    let qv = std::slice::from_raw_parts(q.get().add(item * hd), hd);
                    let mut max = f32::NEG_INFINITY;
                    for (t, s) in scores[..len].iter_mut().enumerate() {
                        let kv = std::slice::from_raw_parts(k.get().add(t * kv_row + kh * hd), hd);
                        let kf: &[f32] = if T::DTYPE == DType::F32 {
                            // T is f32 when its DTYPE is F32 (the only such Elem).
                            std::slice::from_raw_parts(kv.as_ptr().cast::<f32>(), hd)
                        } else {
                            widen(kv, &mut krow);
                            &krow
                        };
                        *s = dot(qv, kf) * scale;
                        max = max.max(*s);
                    }
                    let mut sum = 0f32;
                    for s in &mut scores[..len] {
                        *s = (*s - max).exp();
                        sum += *s;
                    }
                    let inv = 1.0 / sum;
                    acc.fill(0.0);
                    for (t, &s) in scores[..len].iter().enumerate() {
                        let p = s * inv;
                        let vv = std::slice::from_raw_parts(v.get().add(t * kv_row + kh * hd), hd);
                        for (a, y) in acc.iter_mut().zip(vv) {
                            *a += p * y.to_f32();
                        }
                    }
                    std::ptr::copy_nonoverlapping(acc.as_ptr(), o.get().add(item * hd), hd);
                }
            }
        });
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::cpu::{CpuBuf, CpuDevice};
    use crate::{DType, Device, Op, View};

    #[allow(clippy::too_many_arguments)]
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        rows: usize,
        heads: usize,
        kvh: usize,
        hd: usize,
        pos0: usize,
    ) -> Vec<f64> {
        let mut out = vec![0f64; rows * heads * hd];
        let scale = 1.0 / (hd as f64).sqrt();
        for row in 0..rows {
            for h in 0..heads {
                let kh = h / (heads / kvh);
                let len = pos0 + row + 1;
                let qv = &q[(row * heads + h) * hd..][..hd];
                let s: Vec<f64> = (0..len)
                    .map(|t| {
                        let kv = &k[(t * kvh + kh) * hd..][..hd];
                        qv.iter()
                            .zip(kv)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for t in 0..len {
                    for d in 0..hd {
                        out[(row * heads + h) * hd + d] +=
                            e[t] / z * v[(t * kvh + kh) * hd + d] as f64;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn attention_matches_f64_causal_gqa() {
        let dev = CpuDevice::new(0, 2, 10);
        let mut rng = Rng::new(5);
        for dtype in DType::ALL {
            for (rows, heads, kvh, hd, pos0) in [
                (1usize, 2usize, 1usize, 8usize, 0usize),
                (1, 8, 4, 8, 30),
                (6, 4, 2, 16, 0),
                (5, 6, 3, 8, 9),
            ] {
                let seq = pos0 + rows;
                let q: Vec<f32> = rng
                    .vec_sym(rows * heads * hd)
                    .iter()
                    .map(|x| x * 2.0)
                    .collect();
                let k = rounded(
                    dtype,
                    &rng.vec_sym(seq * kvh * hd)
                        .iter()
                        .map(|x| x * 2.0)
                        .collect::<Vec<_>>(),
                );
                let v = rounded(dtype, &rng.vec_sym(seq * kvh * hd));
                let want = reference(&q, &k, &v, rows, heads, kvh, hd, pos0);
                // Qwen3.5's output gate, σ(g) of gates in ±4.
                let g: Vec<f32> = rng.vec_sym(q.len()).iter().map(|x| x * 4.0).collect();
                let gated: Vec<f64> = want
                    .iter()
                    .zip(&g)
                    .map(|(&o, &g)| o / (1.0 + (-g as f64).exp()))
                    .collect();
                let (bq, bk, bv, bg) = (
                    upload(&dev, DType::F32, &q),
                    upload(&dev, dtype, &k),
                    upload(&dev, dtype, &v),
                    upload(&dev, DType::F32, &g),
                );
                let bo = dev.alloc(q.len() * 4).unwrap();
                let pos: Vec<u32> = (0..rows as u32).map(|r| pos0 as u32 + r).collect();
                let bp = upload_u32(&dev, &pos);
                // The op with `gate` (a buffer) as the output gate, or none.
                let run = |gate: Option<&CpuBuf>| {
                    dev.run(&Op::Attention(crate::ops::Attention {
                        q: View::new(&bq, 0, q.len(), DType::F32),
                        k_cache: View::new(&bk, 0, k.len(), dtype),
                        v_cache: View::new(&bv, 0, v.len(), dtype),
                        out: View::new(&bo, 0, q.len(), DType::F32),
                        gate: gate.map(|b| View::new(b, 0, q.len(), DType::F32)),
                        rows,
                        heads,
                        kv_heads: kvh,
                        head_dim: hd,
                        pos: View::new(&bp, 0, rows, DType::U32),
                        slots: None,
                        scale: 1.0 / (hd as f32).sqrt(),
                        workspace: None,
                    }))
                };
                for (gate, want) in [(None, &want), (Some(&bg), &gated)] {
                    run(gate).unwrap();
                    let err = max_err(&download(&dev, &bo, DType::F32, q.len()), want);
                    assert!(
                        err < 1e-5,
                        "{dtype} {rows} {heads} {kvh} gated {}: {err}",
                        gate.is_some()
                    );
                }
                // A gate that overlaps the output would be overwritten before it is read.
                let e = run(Some(&bo)).unwrap_err();
                assert!(
                    e.to_string().contains("out (against the gate) overlaps"),
                    "{e}"
                );
            }
        }
    }
}
