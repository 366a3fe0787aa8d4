//! `Rope`: rotary position embedding in Hugging Face's "rotate halves" layout (element `i`
//! pairs with `i + rotary_dim/2`), in place, over the first `rotary_dim` dims of each head
//! (all of them but for Qwen3.5's partial RoPE, whose other dims pass through).
//!
//! The angle is `pos · inv_freq[i]` rounded to f32, as transformers computes it (an f32
//! matmul of inv_freq and positions); its cos and sin are taken in f64 and rounded, which is
//! what a correctly rounded f32 `cos` gives.

use super::super::{par_ranges, CpuBuf, CpuDevice};
use super::{f32_ptr, MIN_WORK_PER_THREAD};
use crate::{KernelError, Result, View};

pub(crate) fn rope(
    dev: &CpuDevice,
    x: &View<'_, CpuBuf>,
    inv_freq: &View<'_, CpuBuf>,
    rows: usize,
    heads: usize,
    (head_dim, rotary_dim): (usize, usize),
    pos0: usize,
) -> Result<()> {
    let half = rotary_dim / 2;
    if rotary_dim == 0
        || !rotary_dim.is_multiple_of(2)
        || rotary_dim > head_dim
        || inv_freq.len < half
    {
        return Err(KernelError::Invalid(format!(
            "rope: head_dim {head_dim}, rotary_dim {rotary_dim} with {} inverse frequencies",
            inv_freq.len
        )));
    }
    let px = f32_ptr(x, rows * heads * head_dim, "rope x")?;
    let pf = f32_ptr(inv_freq, half, "rope inv_freq")?;
    // SAFETY: checked for `half` elements; read only.
    let freqs = unsafe { std::slice::from_raw_parts(pf.get(), half) };
    par_ranges(
        dev.threads(),
        rows,
        MIN_WORK_PER_THREAD / (heads * head_dim) + 1,
        |r| {
            let mut cs = vec![(0f32, 0f32); half];
            for row in r {
                let pos = (pos0 + row) as f32;
                for (c, &f) in cs.iter_mut().zip(freqs) {
                    let (s, co) = ((pos * f) as f64).sin_cos();
                    *c = (co as f32, s as f32);
                }
                for h in 0..heads {
                    // SAFETY: this head of this row lies inside the checked range and belongs to
                    // this thread's rows only.
                    let v = unsafe {
                        std::slice::from_raw_parts_mut(
                            px.get().add((row * heads + h) * head_dim),
                            head_dim,
                        )
                    };
                    let (lo, hi) = v[..rotary_dim].split_at_mut(half);
                    for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(&cs) {
                        let (x1, x2) = (*a, *b);
                        *a = x1 * c - x2 * s;
                        *b = x2 * c + x1 * s;
                    }
                }
            }
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::cpu::CpuDevice;
    use crate::{DType, Device, Op, View};

    #[test]
    fn rope_matches_f64_rotate_halves() {
        let dev = CpuDevice::new(0, 2, 10);
        let mut rng = Rng::new(4);
        for (rows, heads, hd, pos0) in [
            (1usize, 1usize, 2usize, 0usize),
            (5, 3, 8, 7),
            (40, 4, 64, 1000),
        ] {
            let x = rng.vec_sym(rows * heads * hd);
            let inv: Vec<f32> = (0..hd / 2)
                .map(|i| (1.0 / 10000f64.powf(2.0 * i as f64 / hd as f64)) as f32)
                .collect();
            let want: Vec<f64> = (0..rows * heads)
                .flat_map(|rh| {
                    let pos = (pos0 + rh / heads) as f64;
                    let v = &x[rh * hd..(rh + 1) * hd];
                    let mut o = vec![0f64; hd];
                    for i in 0..hd / 2 {
                        let a = pos * inv[i] as f64;
                        let (x1, x2) = (v[i] as f64, v[i + hd / 2] as f64);
                        o[i] = x1 * a.cos() - x2 * a.sin();
                        o[i + hd / 2] = x2 * a.cos() + x1 * a.sin();
                    }
                    o
                })
                .collect();
            let bx = upload(&dev, DType::F32, &x);
            let bf = upload(&dev, DType::F32, &inv);
            let pos: Vec<u32> = (0..rows as u32).map(|r| pos0 as u32 + r).collect();
            let bp = upload_u32(&dev, &pos);
            dev.run(&Op::Rope(crate::ops::Rope {
                x: View::new(&bx, 0, x.len(), DType::F32),
                inv_freq: View::new(&bf, 0, inv.len(), DType::F32),
                rows,
                heads,
                head_dim: hd,
                pos: View::new(&bp, 0, rows, DType::U32),
            }))
            .unwrap();
            // The f32 angle at position ~1000 carries ~6e-5 absolute error, as in transformers.
            assert!(max_err(&download(&dev, &bx, DType::F32, x.len()), &want) < 2e-4);
        }
    }
}
