//! `Embedding`: rows of one vocab shard of the embedding table, zeros for ids outside it.

use super::super::{par_ranges, CpuBuf, CpuDevice};
use super::{f32_ptr, typed_ptr, MIN_WORK_PER_THREAD};
use crate::dtype::Elem;
use crate::{with_dtype, KernelError, Result, View};

pub(crate) fn embedding(
    dev: &CpuDevice,
    table: &View<'_, CpuBuf>,
    vocab_start: usize,
    ids: &[u32],
    hidden: usize,
    out: &View<'_, CpuBuf>,
) -> Result<()> {
    if hidden == 0 || !table.len.is_multiple_of(hidden) {
        return Err(KernelError::Invalid(format!(
            "embedding: table of {} elements is not [rows, {hidden}]",
            table.len
        )));
    }
    let rows = table.len / hidden;
    let m = ids.len();
    let o = f32_ptr(out, m * hidden, "embedding out")?;
    with_dtype!(table.dtype, T => {
        let t = typed_ptr::<T>(table, table.len, "embedding table")?;
        par_ranges(dev.threads(), m, MIN_WORK_PER_THREAD / hidden + 1, |r| {
            for i in r {
                // SAFETY: row i of `out` is inside the m·hidden elements checked above and
                // belongs to this thread only.
                let dst = unsafe { std::slice::from_raw_parts_mut(o.get().add(i * hidden), hidden) };
                let id = ids[i] as usize;
                match id.checked_sub(vocab_start).filter(|&j| j < rows) {
                    Some(j) => {
                        // SAFETY: j < rows, so the row lies inside the checked table.
                        let src = unsafe { std::slice::from_raw_parts(t.get().add(j * hidden), hidden) };
                        for (d, s) in dst.iter_mut().zip(src) {
                            *d = s.to_f32();
                        }
                    }
                    None => dst.fill(0.0),
                }
            }
        });
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::cpu::CpuDevice;
    use crate::{DType, Device, Op, View};

    #[test]
    fn shards_sum_to_the_full_lookup() {
        let dev = CpuDevice::new(0, 2, 10);
        let mut rng = Rng::new(2);
        let (vocab, hidden) = (37, 24);
        let ids: Vec<u32> = (0..50)
            .map(|_| (rng.next_u64() % vocab as u64) as u32)
            .collect();
        for dtype in DType::ALL {
            let table = rounded(dtype, &rng.vec_sym(vocab * hidden));
            let mut sum = vec![0f64; ids.len() * hidden];
            for world in [1usize, 3] {
                sum.iter_mut().for_each(|s| *s = 0.0);
                for r in 0..world {
                    let sh = crate::comm::shard_range(vocab, world, r);
                    let tb = upload(&dev, dtype, &table[sh.start * hidden..sh.end * hidden]);
                    let out = dev.alloc(ids.len() * hidden * 4).unwrap();
                    let bi = upload_u32(&dev, &ids);
                    dev.run(&Op::Embedding(crate::ops::Embedding {
                        table: View::new(&tb, 0, sh.len() * hidden, dtype),
                        vocab_start: sh.start,
                        ids: View::new(&bi, 0, ids.len(), DType::U32),
                        hidden,
                        out: View::new(&out, 0, ids.len() * hidden, DType::F32),
                    }))
                    .unwrap();
                    let got = download(&dev, &out, DType::F32, ids.len() * hidden);
                    for (s, g) in sum.iter_mut().zip(got) {
                        *s += g as f64;
                    }
                }
                let want: Vec<f32> = ids
                    .iter()
                    .flat_map(|&id| {
                        table[id as usize * hidden..(id as usize + 1) * hidden].to_vec()
                    })
                    .collect();
                let want64: Vec<f64> = want.iter().map(|&x| x as f64).collect();
                let sum32: Vec<f32> = sum.iter().map(|&x| x as f32).collect();
                assert_eq!(max_err(&sum32, &want64), 0.0, "{dtype} world {world}");
            }
        }
    }
}
