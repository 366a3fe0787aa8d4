//! [`LocalComm`]: a [`Collectives`] for ranks that are threads of one process, each with its
//! own device, built on the `oneshot` peer-buffer allreduce over shareable buffers. Used by
//! the tests to run N ranks in one process; the real job uses the rank's communicator.

use std::sync::Arc;
use std::time::Duration;

use tprun_kernels::comm::AddNorm;
use tprun_kernels::{AllreduceArgs, CommAlgo, CommLayout, Device, Op, View};

use crate::{Collectives, RankError};

/// How long a rank waits for its peers in one allreduce before failing: far above any real
/// wait (microseconds), generous enough for unoptimised test builds on a loaded 2-core
/// machine where ranks outnumber cores.
const TIMEOUT: Duration = Duration::from_secs(60);

pub struct LocalComm<D: Device> {
    dev: Arc<D>,
    rank: usize,
    /// Every rank's communication buffer (the same objects in every rank's `LocalComm`).
    bufs: Arc<Vec<D::Buf>>,
    layout: CommLayout,
    /// The next allreduce's epoch: 1, 2, 3, … on every rank alike.
    epoch: u32,
}

impl<D: Device> LocalComm<D> {
    /// One communicator per device (rank i = `devs[i]`), each able to reduce messages of up to
    /// `max_bytes` in one call (longer ones are split into several calls).
    pub fn world(devs: &[Arc<D>], max_bytes: usize) -> Result<Vec<LocalComm<D>>, RankError> {
        let layout = CommLayout::new(max_bytes, devs.len());
        let bufs = devs
            .iter()
            .map(|d| Ok(d.alloc_shared(layout.total_bytes())?.0))
            .collect::<Result<Vec<_>, RankError>>()?;
        let bufs = Arc::new(bufs);
        Ok(devs
            .iter()
            .enumerate()
            .map(|(rank, d)| LocalComm {
                dev: d.clone(),
                rank,
                bufs: bufs.clone(),
                layout,
                epoch: 1,
            })
            .collect())
    }
}

impl<D: Device> Collectives<D> for LocalComm<D> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.bufs.len()
    }

    fn allreduce(&mut self, data: View<'_, D::Buf>) -> Result<(), RankError> {
        let per_call = (self.layout.data_bytes / data.dtype.size()).max(1);
        let comm: Vec<&D::Buf> = self.bufs.iter().collect();
        let mut start = 0;
        while start < data.len {
            let n = per_call.min(data.len - start);
            self.dev.run(&Op::Allreduce(AllreduceArgs {
                algo: CommAlgo::Oneshot,
                rank: self.rank,
                world: comm.len(),
                epoch: self.epoch,
                data: data.slice(start, n),
                comm: &comm,
                layout: self.layout,
                timeout: TIMEOUT,
                abort: None,
                add_norm: None,
            }))?;
            self.epoch = self.epoch.wrapping_add(1);
            start += n;
        }
        Ok(())
    }

    fn allreduce_add_norm(
        &mut self,
        data: View<'_, D::Buf>,
        add_norm: AddNorm<'_, D::Buf>,
    ) -> Result<(), RankError> {
        self.allreduce(data)?;
        let op = add_norm.op(data);
        self.dev.run(&Op::AddRmsNorm(op))?;
        Ok(())
    }

    fn epoch(&self) -> u32 {
        self.epoch
    }

    fn set_epoch(&mut self, epoch: u32) {
        self.epoch = epoch;
    }
}
