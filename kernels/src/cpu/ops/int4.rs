//! `MatmulInt4`: `y = f(x) · wᵀ` over GPTQ int4 weights in the layout of [`crate::int4`], the
//! CPU twin of `kernels/src/gpu/gemv_q4.cu`.
//!
//! The activations of every token are computed once ([`crate::ops::Prologue`]) and gathered
//! through `perm` into stored-input order; threads split the output rows, and each row is
//! dequantised into an f32 scratch row (`(q − z) · s` is exact in f32; a 16-entry table per
//! group) and dotted with every token's activations ([`dot`]). Slow next to the GPU kernel
//! (it widens 8 bytes per 4-bit weight), but plain: the reference the GPU is held to.

use super::super::{par_ranges, CpuBuf, CpuDevice};
use super::elementwise::silu_mul_epilogue;
use super::{dot, f32_ptr, typed_ptr, MIN_WORK_PER_THREAD};
use crate::int4::PACK;
use crate::ops::{Epilogue, MatmulInt4, Prologue};
use crate::{KernelError, Result};

pub(crate) fn matmul_int4(dev: &CpuDevice, a: &MatmulInt4<'_, CpuBuf>) -> Result<()> {
    let (m, k, n, kq, group, groups) = (a.m, a.k, a.n, a.kq(), a.group, a.groups);
    if a.epilogue == Epilogue::SiluMul {
        return silu_mul_epilogue(dev, m, n, &a.y, |full| {
            let plain = MatmulInt4 {
                y: full,
                epilogue: Epilogue::None,
                ..*a
            };
            matmul_int4(dev, &plain)
        });
    }
    let xk = a.prologue.x_width(k);
    let px = f32_ptr(&a.x, m * xk, "matmul_int4 x")?;
    // SAFETY: f32_ptr checked m·xk f32 elements; y (written below) does not overlap them.
    let x = unsafe { std::slice::from_raw_parts(px.get(), m * xk) };
    let perm = match &a.perm {
        Some(p) => {
            let pp = typed_ptr::<u32>(p, kq, "matmul_int4 perm")?;
            // SAFETY: typed_ptr checked kq elements; only read.
            Some(unsafe { std::slice::from_raw_parts(pp.get(), kq) })
        }
        None => None,
    };
    if let Some(&bad) = perm.and_then(|p| p.iter().find(|&&i| i as usize >= k)) {
        return Err(KernelError::Invalid(format!(
            "matmul_int4: perm holds {bad}, k is {k}"
        )));
    }
    // Activations in stored-input order: xs[t][j] = f(x)[t][perm[j]].
    let mut xs = vec![0f32; m * kq];
    for t in 0..m {
        let row = &x[t * xk..(t + 1) * xk];
        for (j, d) in xs[t * kq..(t + 1) * kq].iter_mut().enumerate() {
            let i = perm.map_or(j, |p| p[j] as usize);
            *d = match a.prologue {
                Prologue::None => row[i],
                // silu(g) · u as elementwise.rs writes it.
                Prologue::SiluMul => {
                    let (g, u) = (row[i], row[k + i]);
                    g / (1.0 + (-g).exp()) * u
                }
            };
        }
    }
    let zw = groups.div_ceil(PACK);
    let qw = typed_ptr::<u32>(&a.qweight, n * kq / PACK, "matmul_int4 qweight")?;
    let sc = typed_ptr::<half::f16>(&a.scales, n * groups, "matmul_int4 scales")?;
    let zp = typed_ptr::<u32>(&a.zeros, n * zw, "matmul_int4 zeros")?;
    let py = f32_ptr(&a.y, m * n, "matmul_int4 y")?;
    let min_rows = MIN_WORK_PER_THREAD / (m * kq).max(1) + 1;
    par_ranges(dev.threads(), n, min_rows, |rows| {
        let mut wf = vec![0f32; kq];
        for row in rows {
            // SAFETY: row < n; the three weight buffers hold n rows of these lengths (checked
            // above) and are only read.
            let (q, s, z) = unsafe {
                (
                    std::slice::from_raw_parts(qw.get().add(row * kq / PACK), kq / PACK),
                    std::slice::from_raw_parts(sc.get().add(row * groups), groups),
                    std::slice::from_raw_parts(zp.get().add(row * zw), zw),
                )
            };
            // Per group the 16 values a nibble can stand for, then one lookup per weight.
            let words = group / PACK;
            for g in 0..groups {
                let zv = ((z[g / PACK] >> (4 * (g % PACK))) & 0xf) as f32;
                let sg = s[g].to_f32();
                let lut: [f32; 16] = std::array::from_fn(|v| (v as f32 - zv) * sg);
                let dst = &mut wf[g * group..(g + 1) * group];
                for (d8, &w) in dst
                    .chunks_exact_mut(PACK)
                    .zip(&q[g * words..(g + 1) * words])
                {
                    for (i, d) in d8.iter_mut().enumerate() {
                        *d = lut[((w >> (4 * i)) & 0xf) as usize];
                    }
                }
            }
            for t in 0..m {
                let v = dot(&xs[t * kq..(t + 1) * kq], &wf);
                // SAFETY: t·n + row < m·n; row is this thread's; y overlaps no input
                // (MatmulInt4::validate(), which Device::launch requires).
                unsafe { *py.get().add(t * n + row) = v };
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::cpu::CpuDevice;
    use crate::int4::{Int4Host, PACK};
    use crate::ops::{Epilogue, MatmulInt4, Prologue};
    use crate::{DType, Device, Op, View};

    /// A random layer of `n` rows over `k` inputs in groups of `gl` (`desc_act`: the inputs
    /// in a shuffled group order, as GPTQ's act-order writes g_idx).
    pub(crate) fn layer(rng: &mut Rng, n: usize, k: usize, gl: usize, desc_act: bool) -> Int4Host {
        let ng = k / gl;
        let mut order: Vec<usize> = (0..k).collect();
        if desc_act {
            for i in (1..k).rev() {
                order.swap(i, rng.next_u64() as usize % (i + 1));
            }
        }
        let mut g_idx = vec![0u32; k];
        for (pos, &c) in order.iter().enumerate() {
            g_idx[c] = (pos / gl) as u32;
        }
        let qw: Vec<u32> = (0..k / PACK * n).map(|_| rng.next_u64() as u32).collect();
        let z: Vec<u8> = (0..ng * n).map(|_| (rng.next_u64() % 16) as u8).collect();
        let s: Vec<f32> = (0..ng * n)
            .map(|_| half::f16::from_f32(0.002 + rng.f64() as f32 * 0.05).to_f32())
            .collect();
        Int4Host::from_gptq(n, k, &qw, &z, &s, &g_idx).unwrap()
    }

    /// Runs the op on the CPU over `h` and the activations `x`; `y` poisoned first.
    pub(crate) fn run(
        dev: &CpuDevice,
        h: &Int4Host,
        x: &[f32],
        m: usize,
        pro: Prologue,
    ) -> Vec<f32> {
        run_with(dev, h, x, m, pro, Epilogue::None)
    }

    /// [`run`] with an epilogue (y: [m, n/2] under SiluMul).
    fn run_with(
        dev: &CpuDevice,
        h: &Int4Host,
        x: &[f32],
        m: usize,
        pro: Prologue,
        epi: Epilogue,
    ) -> Vec<f32> {
        let yn = epi.y_width(h.n);
        let u32s = |v: &[u32]| upload_u32(dev, v);
        let (bq, bz) = (u32s(&h.qweight), u32s(&h.zeros));
        let bs = dev.alloc(2 * h.scales.len()).unwrap();
        let sb: Vec<u8> = h.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        dev.write(&bs, 0, &sb).unwrap();
        let bp = h.perm.as_ref().map(|p| u32s(p));
        let bx = upload(dev, DType::F32, x);
        let by = dev.alloc(m * yn * 4).unwrap();
        dev.write(&by, 0, &vec![0xff; m * yn * 4]).unwrap();
        dev.run(&Op::MatmulInt4(MatmulInt4 {
            x: View::new(&bx, 0, x.len(), DType::F32),
            qweight: View::new(&bq, 0, h.qweight.len(), DType::U32),
            scales: View::new(&bs, 0, h.scales.len(), DType::F16),
            zeros: View::new(&bz, 0, h.zeros.len(), DType::U32),
            perm: bp.as_ref().map(|b| View::new(b, 0, h.kq(), DType::U32)),
            y: View::new(&by, 0, m * yn, DType::F32),
            m,
            k: h.k,
            n: h.n,
            group: h.group,
            groups: h.groups,
            prologue: pro,
            epilogue: epi,
        }))
        .unwrap();
        download(dev, &by, DType::F32, m * yn)
    }

    /// The f64 product of f(x) and the dequantised weights.
    fn reference(h: &Int4Host, x: &[f32], m: usize, pro: Prologue) -> Vec<f64> {
        let (k, n) = (h.k, h.n);
        let w = h.dequantize();
        let act: Vec<f64> = (0..m * k)
            .map(|i| {
                let (t, c) = (i / k, i % k);
                match pro {
                    Prologue::None => x[i] as f64,
                    Prologue::SiluMul => {
                        let (g, u) = (x[t * 2 * k + c] as f64, x[t * 2 * k + k + c] as f64);
                        g / (1.0 + (-g).exp()) * u
                    }
                }
            })
            .collect();
        (0..m * n)
            .map(|i| {
                let (t, row) = (i / n, i % n);
                (0..k).map(|c| act[t * k + c] * w[row * k + c] as f64).sum()
            })
            .collect()
    }

    #[test]
    fn matches_f64_for_every_group_size_desc_act_and_prologue() {
        let mut rng = Rng::new(41);
        for threads in [1usize, 2] {
            let dev = CpuDevice::new(0, threads, 10);
            for (n, k) in [(24usize, 256usize), (40, 512)] {
                for gl in [32usize, 64, 128, k] {
                    for desc_act in [false, true] {
                        let h = layer(&mut rng, n, k, gl, desc_act);
                        // One group over all of k needs no order.
                        assert_eq!(h.perm.is_some(), desc_act && gl < k);
                        for (m, pro) in [(1usize, Prologue::None), (3, Prologue::SiluMul)] {
                            let xk = if pro == Prologue::None { k } else { 2 * k };
                            let x: Vec<f32> = rng.vec_sym(m * xk).iter().map(|v| v * 2.0).collect();
                            let got = run(&dev, &h, &x, m, pro);
                            let err = max_err(&got, &reference(&h, &x, m, pro));
                            assert!(err < 1e-5, "n{n} k{k} g{gl} {desc_act} m{m}: {err}");
                        }
                    }
                }
            }
        }
    }

    /// The epilogue writes silu(gate) · up of the two halves' sums, in f64 terms.
    #[test]
    fn the_epilogue_activates_gate_with_up() {
        let mut rng = Rng::new(43);
        let dev = CpuDevice::new(0, 2, 10);
        for (m, desc_act) in [(1usize, false), (3, true)] {
            let (n, k) = (40usize, 256usize);
            let h = layer(&mut rng, n, k, 64, desc_act);
            let x: Vec<f32> = rng.vec_sym(m * k).iter().map(|v| v * 2.0).collect();
            let got = run_with(&dev, &h, &x, m, Prologue::None, Epilogue::SiluMul);
            let full = reference(&h, &x, m, Prologue::None);
            let want: Vec<f64> = (0..m * n / 2)
                .map(|i| {
                    let (t, j) = (i / (n / 2), i % (n / 2));
                    let (g, u) = (full[t * n + j], full[t * n + n / 2 + j]);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            let err = max_err(&got, &want);
            assert!(err < 1e-5, "m{m} {desc_act}: {err}");
        }
    }

    #[test]
    fn padded_groups_of_a_shard_add_nothing() {
        // The first 40 inputs of a desc_act layer: ragged groups, padded with q = z.
        let mut rng = Rng::new(42);
        let (n, k, gl) = (16usize, 128usize, 32usize);
        let full = layer(&mut rng, n, k, gl, true);
        let w = full.dequantize();
        // Re-derive GPTQ arrays for inputs 0..40 from the full layer's meaning: quantize
        // exactly by reading q/z/s back per (row, input).
        let perm = full.perm.as_ref().unwrap();
        let mut g_idx = vec![0u32; 40];
        let mut qw = vec![0u32; 40 / PACK * n];
        for (j, &c) in perm.iter().enumerate() {
            let c = c as usize;
            if c < 40 {
                g_idx[c] = (j / gl) as u32;
                for row in 0..n {
                    qw[c / PACK * n + row] |= u32::from(full.q(row, j)) << (4 * (c % PACK));
                }
            }
        }
        let z: Vec<u8> = (0..4 * n).map(|i| full.zero(i % n, i / n)).collect();
        let s: Vec<f32> = (0..4 * n).map(|i| full.scale(i % n, i / n)).collect();
        let h = Int4Host::from_gptq(n, 40, &qw, &z, &s, &g_idx).unwrap();
        assert!(h.kq() > 40);
        let cut: Vec<f32> = (0..n).flat_map(|r| w[r * k..r * k + 40].to_vec()).collect();
        assert_eq!(h.dequantize(), cut);
        let dev = CpuDevice::new(0, 1, 10);
        let x = rng.vec_sym(40);
        let err = max_err(
            &run(&dev, &h, &x, 1, Prologue::None),
            &reference(&h, &x, 1, Prologue::None),
        );
        assert!(err < 1e-5, "{err}");
    }
}
