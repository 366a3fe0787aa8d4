//! CPU twins of the Gated DeltaNet ops (Qwen3.5's `linear_attention` layers):
//! [`ops::CausalConv`] (the short causal convolution + SiLU), [`ops::GatedDelta`] (the gated
//! delta rule, token by token through one sequence's recurrent state, as transformers'
//! `torch_recurrent_gated_delta_rule`) and [`ops::GatedRmsNorm`] (the closing norm, gated by
//! SiLU(z)). All f32, in the reference's order of operations.
//!
//! Must not: keep anything between calls (the state lives in the caller's buffer).

use super::super::CpuBuf;
use super::decode::{read_f32, write_f32};
use crate::ops::{self, DELTA_L2_EPS};
use crate::Result;

/// softplus(x) = ln(1 + eˣ), linear above 20 as torch's `F.softplus` (beta 1, threshold 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x / √(Σx² + ε) · scale`, in place.
fn l2_normalise(x: &mut [f32], scale: f32) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + DELTA_L2_EPS).sqrt();
    for v in x {
        *v = *v * inv * scale;
    }
}

/// silu(x) = x / (1 + e^−x), as elementwise.rs.
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub(crate) fn causal_conv(a: &ops::CausalConv<'_, CpuBuf>) -> Result<()> {
    let (c, kn) = (a.channels, a.kernel);
    let x = read_f32(&a.x)?;
    let w = read_f32(&a.w)?;
    let mut state = read_f32(&a.state)?;
    let mut out = vec![0.0f32; a.rows * c];
    for r in 0..a.rows {
        for ch in 0..c {
            let past = &mut state[ch * (kn - 1)..(ch + 1) * (kn - 1)];
            let wc = &w[ch * kn..(ch + 1) * kn];
            let new = x[r * c + ch];
            let mut acc = 0.0f32;
            for (j, &p) in past.iter().enumerate() {
                acc += wc[j] * p;
            }
            acc += wc[kn - 1] * new;
            out[r * c + ch] = silu(acc);
            past.rotate_left(1);
            past[kn - 2] = new;
        }
    }
    write_f32(&a.state, &state)?;
    write_f32(&a.out, &out)
}

pub(crate) fn gated_rms_norm(a: &ops::GatedRmsNorm<'_, CpuBuf>) -> Result<()> {
    let d = a.dim;
    let x = read_f32(&a.x)?;
    let z = read_f32(&a.z)?;
    let w = read_f32(&a.w)?;
    let mut out = vec![0.0f32; a.rows * d];
    for r in 0..a.rows {
        let xr = &x[r * d..(r + 1) * d];
        let ss: f32 = xr.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / d as f32 + a.eps).sqrt();
        for j in 0..d {
            out[r * d + j] = (xr[j] * inv) * w[j] * silu(z[r * d + j]);
        }
    }
    write_f32(&a.out, &out)
}

pub(crate) fn gated_delta(a: &ops::GatedDelta<'_, CpuBuf>) -> Result<()> {
    let (kh, vh, dk, dv, rows) = (a.k_heads, a.v_heads, a.dk, a.dv, a.rows);
    let width = 2 * kh * dk + vh * dv;
    let per_key = vh / kh;
    let qkv = read_f32(&a.qkv)?;
    let (b, av) = (read_f32(&a.b)?, read_f32(&a.a)?);
    let (a_log, dt_bias) = (read_f32(&a.a_log)?, read_f32(&a.dt_bias)?);
    let mut state = read_f32(&a.state)?;
    let mut out = vec![0.0f32; rows * vh * dv];
    let scale = 1.0 / (dk as f32).sqrt();
    let mut kv_mem = vec![0.0f32; dv];
    for r in 0..rows {
        let row = &qkv[r * width..(r + 1) * width];
        let mut q = row[..kh * dk].to_vec();
        let mut k = row[kh * dk..2 * kh * dk].to_vec();
        let v = &row[2 * kh * dk..];
        for h in 0..kh {
            l2_normalise(&mut q[h * dk..(h + 1) * dk], scale);
            l2_normalise(&mut k[h * dk..(h + 1) * dk], 1.0);
        }
        for h in 0..vh {
            let (qh, kh_) = (
                &q[h / per_key * dk..(h / per_key + 1) * dk],
                &k[h / per_key * dk..(h / per_key + 1) * dk],
            );
            let vv = &v[h * dv..(h + 1) * dv];
            let beta = 1.0 / (1.0 + (-b[r * vh + h]).exp());
            let g = -a_log[h].exp() * softplus(av[r * vh + h] + dt_bias[h]);
            let decay = g.exp();
            let s = &mut state[h * dk * dv..(h + 1) * dk * dv];
            for x in s.iter_mut() {
                *x *= decay;
            }
            // kv_mem = Sᵀk, then δ = β (v − kv_mem), S += k δᵀ, o = Sᵀq.
            kv_mem.fill(0.0);
            for i in 0..dk {
                for j in 0..dv {
                    kv_mem[j] += s[i * dv + j] * kh_[i];
                }
            }
            for j in 0..dv {
                kv_mem[j] = (vv[j] - kv_mem[j]) * beta;
            }
            let o = &mut out[(r * vh + h) * dv..(r * vh + h + 1) * dv];
            for i in 0..dk {
                for j in 0..dv {
                    s[i * dv + j] += kh_[i] * kv_mem[j];
                    o[j] += s[i * dv + j] * qh[i];
                }
            }
        }
    }
    write_f32(&a.state, &state)?;
    write_f32(&a.out, &out)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::cpu::{CpuBuf, CpuDevice};
    use crate::ops::GatedDelta;
    use crate::{DType, Device, Op, View};

    /// The recurrence in f64, written from the formulas of `ops::GatedDelta` (not from the
    /// code above): returns (out, final state).
    #[allow(clippy::too_many_arguments)]
    fn reference(
        qkv: &[f32],
        b: &[f32],
        a: &[f32],
        a_log: &[f32],
        dt_bias: &[f32],
        state: &[f32],
        (rows, kh, vh, dk, dv): (usize, usize, usize, usize, usize),
    ) -> (Vec<f64>, Vec<f64>) {
        let width = 2 * kh * dk + vh * dv;
        let mut s: Vec<f64> = state.iter().map(|&x| x as f64).collect();
        let mut out = vec![0.0f64; rows * vh * dv];
        let norm = |x: &[f32], scale: f64| -> Vec<f64> {
            let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
            x.iter()
                .map(|&v| v as f64 / (ss + 1e-6).sqrt() * scale)
                .collect()
        };
        for r in 0..rows {
            let row = &qkv[r * width..(r + 1) * width];
            for h in 0..vh {
                let key = h / (vh / kh);
                let q = norm(&row[key * dk..(key + 1) * dk], 1.0 / (dk as f64).sqrt());
                let k = norm(&row[kh * dk + key * dk..kh * dk + (key + 1) * dk], 1.0);
                let v = &row[2 * kh * dk + h * dv..2 * kh * dk + (h + 1) * dv];
                let beta = 1.0 / (1.0 + (-(b[r * vh + h] as f64)).exp());
                let x = a[r * vh + h] as f64 + dt_bias[h] as f64;
                let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
                let g = -(a_log[h] as f64).exp() * sp;
                let sh = &mut s[h * dk * dv..(h + 1) * dk * dv];
                sh.iter_mut().for_each(|e| *e *= g.exp());
                let delta: Vec<f64> = (0..dv)
                    .map(|j| {
                        let mem: f64 = (0..dk).map(|i| sh[i * dv + j] * k[i]).sum();
                        (v[j] as f64 - mem) * beta
                    })
                    .collect();
                for i in 0..dk {
                    for j in 0..dv {
                        sh[i * dv + j] += k[i] * delta[j];
                    }
                }
                for j in 0..dv {
                    out[(r * vh + h) * dv + j] = (0..dk).map(|i| sh[i * dv + j] * q[i]).sum();
                }
            }
        }
        (out, s)
    }

    struct Case {
        bufs: [CpuBuf; 7],
        shape: (usize, usize, usize, usize, usize),
    }

    impl Case {
        fn op(&self, rows: usize, row0: usize) -> Op<'_, CpuBuf> {
            let (_, kh, vh, dk, dv) = self.shape;
            let width = 2 * kh * dk + vh * dv;
            let f = |i: usize, at: usize, n: usize| View::new(&self.bufs[i], at * 4, n, DType::F32);
            Op::GatedDelta(GatedDelta {
                qkv: f(0, row0 * width, rows * width),
                b: f(1, row0 * vh, rows * vh),
                a: f(2, row0 * vh, rows * vh),
                a_log: f(3, 0, vh),
                dt_bias: f(4, 0, vh),
                state: f(5, 0, vh * dk * dv),
                out: f(6, row0 * vh * dv, rows * vh * dv),
                rows,
                k_heads: kh,
                v_heads: vh,
                dk,
                dv,
            })
        }
    }

    /// Random inputs of the model's ranges: conv outputs of a few units, b and a around 0,
    /// A_log = ln(1..16) as initialised by transformers, small dt_bias, a warm state.
    fn inputs(seed: u64, shape: (usize, usize, usize, usize, usize)) -> Vec<Vec<f32>> {
        let (rows, kh, vh, dk, dv) = shape;
        let mut rng = Rng::new(seed);
        let sym = |rng: &mut Rng, n: usize, s: f32| -> Vec<f32> {
            rng.vec_sym(n).iter().map(|x| x * s).collect()
        };
        vec![
            sym(&mut rng, rows * (2 * kh * dk + vh * dv), 2.0),
            sym(&mut rng, rows * vh, 3.0),
            sym(&mut rng, rows * vh, 3.0),
            (0..vh)
                .map(|_| (1.0 + 15.0 * rng.f64() as f32).ln())
                .collect(),
            sym(&mut rng, vh, 0.5),
            sym(&mut rng, vh * dk * dv, 0.3),
        ]
    }

    fn case(dev: &CpuDevice, inp: &[Vec<f32>], shape: (usize, usize, usize, usize, usize)) -> Case {
        let (rows, _, vh, _, dv) = shape;
        let up = |v: &[f32]| upload(dev, DType::F32, v);
        Case {
            bufs: [
                up(&inp[0]),
                up(&inp[1]),
                up(&inp[2]),
                up(&inp[3]),
                up(&inp[4]),
                up(&inp[5]),
                // Poisoned: every output element must be written.
                up(&vec![f32::NAN; rows * vh * dv]),
            ],
            shape,
        }
    }

    #[test]
    fn matches_the_f64_recurrence_and_runs_token_by_token_alike() {
        let dev = CpuDevice::new(0, 2, 0);
        // (rows, key heads, value heads, dk, dv): Qwen3.5-27B's per-rank shape at TP=4
        // (4 key heads, 12 value heads of 128), GQA ratios 1 and 3, odd sizes.
        for (seed, shape) in [
            (1u64, (5usize, 4usize, 12usize, 128usize, 128usize)),
            (2, (3, 2, 2, 16, 8)),
            (3, (7, 1, 3, 5, 7)),
        ] {
            let (rows, _, vh, dk, dv) = shape;
            let inp = inputs(seed, shape);
            let whole = case(&dev, &inp, shape);
            dev.run(&whole.op(rows, 0)).unwrap();
            let out = download(&dev, &whole.bufs[6], DType::F32, rows * vh * dv);
            let state = download(&dev, &whole.bufs[5], DType::F32, vh * dk * dv);
            let (rout, rstate) =
                reference(&inp[0], &inp[1], &inp[2], &inp[3], &inp[4], &inp[5], shape);
            let (eo, es) = (max_err(&out, &rout), max_err(&state, &rstate));
            assert!(
                eo < 1e-4 && es < 1e-4,
                "{shape:?}: out {eo:.2e}, state {es:.2e}"
            );
            // The same tokens one call each leave the same state and outputs, bit for bit:
            // prefill by the recurrence equals decode.
            let steps = case(&dev, &inp, shape);
            for r in 0..rows {
                dev.run(&steps.op(1, r)).unwrap();
            }
            assert_eq!(
                download(&dev, &steps.bufs[6], DType::F32, rows * vh * dv),
                out,
                "{shape:?}"
            );
            assert_eq!(
                download(&dev, &steps.bufs[5], DType::F32, vh * dk * dv),
                state,
                "{shape:?}"
            );
        }
    }

    /// The convolution against an f64 one over the whole padded sequence (zeros before the
    /// first input, as a fresh state), poisoned outputs; then the same rows one call each.
    #[test]
    fn causal_conv_matches_a_padded_convolution() {
        let dev = CpuDevice::new(0, 1, 0);
        let (rows, c, kn) = (6usize, 5usize, 4usize);
        let mut rng = Rng::new(11);
        let x = rng.vec_sym(rows * c);
        let w = rng.vec_sym(c * kn);
        fn f(b: &CpuBuf, at: usize, n: usize) -> View<'_, CpuBuf> {
            View::new(b, at * 4, n, DType::F32)
        }
        let run = |per_call: usize| -> (Vec<f32>, Vec<f32>) {
            let (xb, wb) = (upload(&dev, DType::F32, &x), upload(&dev, DType::F32, &w));
            let sb = upload(&dev, DType::F32, &vec![0.0; c * (kn - 1)]);
            let ob = upload(&dev, DType::F32, &vec![f32::NAN; rows * c]);
            for r0 in (0..rows).step_by(per_call) {
                dev.run(&Op::CausalConv(crate::ops::CausalConv {
                    x: f(&xb, r0 * c, per_call * c),
                    w: f(&wb, 0, c * kn),
                    state: f(&sb, 0, c * (kn - 1)),
                    out: f(&ob, r0 * c, per_call * c),
                    rows: per_call,
                    channels: c,
                    kernel: kn,
                }))
                .unwrap();
            }
            (
                download(&dev, &ob, DType::F32, rows * c),
                download(&dev, &sb, DType::F32, c * (kn - 1)),
            )
        };
        let (out, state) = run(rows);
        let reference: Vec<f64> = (0..rows * c)
            .map(|i| {
                let (r, ch) = (i / c, i % c);
                let acc: f64 = (0..kn)
                    .filter(|&j| r + j + 1 >= kn)
                    .map(|j| w[ch * kn + j] as f64 * x[(r + j + 1 - kn) * c + ch] as f64)
                    .sum();
                acc / (1.0 + (-acc).exp())
            })
            .collect();
        assert!(
            max_err(&out, &reference) < 1e-6,
            "{:e}",
            max_err(&out, &reference)
        );
        // The state holds the last kernel − 1 inputs of each channel, oldest first.
        for ch in 0..c {
            for j in 0..kn - 1 {
                assert_eq!(state[ch * (kn - 1) + j], x[(rows - (kn - 1) + j) * c + ch]);
            }
        }
        assert_eq!(run(1), (out, state));
    }

    #[test]
    fn gated_rms_norm_matches_f64() {
        let dev = CpuDevice::new(0, 1, 0);
        let (rows, d) = (3usize, 16usize);
        let mut rng = Rng::new(12);
        let (x, z, w) = (rng.vec_sym(rows * d), rng.vec_sym(rows * d), rng.vec_sym(d));
        let (xb, zb, wb) = (
            upload(&dev, DType::F32, &x),
            upload(&dev, DType::F32, &z),
            upload(&dev, DType::F32, &w),
        );
        let ob = upload(&dev, DType::F32, &vec![f32::NAN; rows * d]);
        fn f(b: &CpuBuf, n: usize) -> View<'_, CpuBuf> {
            View::new(b, 0, n, DType::F32)
        }
        dev.run(&Op::GatedRmsNorm(crate::ops::GatedRmsNorm {
            x: f(&xb, rows * d),
            z: f(&zb, rows * d),
            w: f(&wb, d),
            out: f(&ob, rows * d),
            rows,
            dim: d,
            eps: 1e-6,
        }))
        .unwrap();
        let reference: Vec<f64> = (0..rows * d)
            .map(|i| {
                let r = i / d;
                let ms: f64 = x[r * d..(r + 1) * d]
                    .iter()
                    .map(|&v| (v as f64).powi(2))
                    .sum::<f64>()
                    / d as f64;
                let zz = z[i] as f64;
                x[i] as f64 / (ms + 1e-6).sqrt() * w[i % d] as f64 * zz / (1.0 + (-zz).exp())
            })
            .collect();
        let out = download(&dev, &ob, DType::F32, rows * d);
        assert!(
            max_err(&out, &reference) < 1e-6,
            "{:e}",
            max_err(&out, &reference)
        );
    }

    #[test]
    fn bad_shapes_are_refused() {
        let dev = CpuDevice::new(0, 1, 0);
        let shape = (1, 2, 3, 4, 4);
        let c = case(&dev, &inputs(9, (1, 2, 4, 4, 4)), (1, 2, 4, 4, 4));
        // 3 value heads over 2 key heads.
        let Op::GatedDelta(mut g) = c.op(1, 0) else {
            unreachable!()
        };
        (g.k_heads, g.v_heads) = (shape.1, shape.2);
        let e = dev.run(&Op::GatedDelta(g)).unwrap_err().to_string();
        assert!(
            e.contains("gated_delta") && e.contains("3 value heads"),
            "{e}"
        );
        let Op::GatedDelta(mut g) = c.op(1, 0) else {
            unreachable!()
        };
        g.dv = 5;
        let e = dev.run(&Op::GatedDelta(g)).unwrap_err().to_string();
        assert!(e.contains("qkv has"), "{e}");
    }
}
