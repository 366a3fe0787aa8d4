//! The communicator: this rank's communication buffer, the peers' buffers mapped into this
//! process, and the allreduce algorithms of DESIGN.md.
//!
//! | algorithm | how |
//! | --- | --- |
//! | `host` | copy into own slot; sync; control-block barrier; `Op::Allreduce` (`HostReduce`): sum every rank's slot, queued, not waited for |
//! | `oneshot` | one `Op::Allreduce`: publish, flag every peer, wait for all flags, reduce everything (GPUs: messages up to 64 KiB go with their flags inside the data, `comm.cu`) |
//! | `twoshot` | one `Op::Allreduce`: reduce-scatter through peer buffers, flags, all-gather |
//! | `auto` | picks one of the above by message size and world size ([`auto_pick`]) |
//!
//! All of them sum in rank order with f32 accumulation, so every rank gets bitwise the same
//! result, and each algorithm gives the same bits as the others.

use std::sync::Arc;
use std::time::Duration;

use tprun_ipc::control::describe_abort;
use tprun_ipc::wire::ExportItem;
use tprun_ipc::{Conn, ControlBlock, IpcError, Msg};
use tprun_kernels::comm::{AddNorm, AllreduceArgs, CommAlgo, CommLayout};
use tprun_kernels::{Device, Export, ExportMeta, Op, View};

use crate::job::{Algo, Backend};
use crate::run::RankCtx;
use crate::{Collectives, RankError};

/// Picks the algorithm `auto` stands for.
///
/// CPU: measured on the 2-core CI machine with 4 ranks (docs/perf-notes.md): oneshot wins up
/// to 64 KiB (one flag phase instead of two), twoshot from 128 KiB (each rank reduces a quarter
/// of the elements instead of all of them: 230 µs against 300 µs at 256 KiB). GPU entries come
/// from the H200 runs in the same notes.
pub fn auto_pick(backend: Backend, bytes: usize, world: usize) -> Algo {
    if bytes <= auto_threshold(backend, world) {
        Algo::Oneshot
    } else {
        Algo::Twoshot
    }
}

/// The largest message `auto` sends with oneshot (`bench allreduce --tune` measures the
/// crossover on a machine).
pub fn auto_threshold(backend: Backend, world: usize) -> usize {
    if world == 1 {
        return usize::MAX;
    }
    match backend {
        Backend::Cpu => 64 << 10,
        Backend::Cuda | Backend::Hip => 512 << 10,
    }
}

/// How often [`wait_for_peers`] looks at the abort word and the heartbeats.
const PEERS_POLL: Duration = Duration::from_millis(20);
/// How much longer than `--timeout` [`wait_for_peers`] waits with no progress anywhere: two
/// seconds past the coordinator's own stall check (`--timeout` + 1 s, coordinator/src/launch.rs),
/// so that the coordinator, which knows who has not exported, names the stalled rank first.
const PEERS_SLACK: Duration = Duration::from_secs(3);

/// Waits for the coordinator's `Peers`, sent once every rank has exported its buffer. A peer
/// may take long to get there (loading a large shard), so the deadline counts from the last
/// heartbeat of any rank, not from the start; only the coordinator knows which rank has not
/// exported, so it times out first and names it, and ours is a fallback. Ends early when the
/// job is aborted.
fn wait_for_peers(
    conn: &Conn,
    control: &ControlBlock,
    timeout: Duration,
) -> Result<(Msg, Vec<std::os::fd::OwnedFd>), RankError> {
    let beats = || {
        (0..control.world())
            .map(|r| control.heartbeat(r))
            .collect::<Vec<u64>>()
    };
    let mut last = beats();
    let mut since = std::time::Instant::now();
    loop {
        match conn.recv(Some(PEERS_POLL)) {
            Ok(m) => return Ok(m),
            Err(IpcError::Timeout(_)) => {}
            Err(e) => {
                return Err(RankError::Other(format!(
                    "waiting for the peers' exports: {e}"
                )))
            }
        }
        if let Some((reason, who)) = control.aborted() {
            return Err(IpcError::Aborted(describe_abort(reason, who)).into());
        }
        let now = beats();
        if now != last {
            last = now;
            since = std::time::Instant::now();
        } else if since.elapsed() > timeout + PEERS_SLACK {
            return Err(RankError::Stalled(format!(
                "waiting for the peers' exports: no rank made progress for {:.0?}",
                since.elapsed()
            )));
        }
    }
}

/// The device op a resolved algorithm runs (`host` runs `HostReduce` after its host steps).
fn device_algo(resolved: Algo) -> CommAlgo {
    match resolved {
        Algo::Host => CommAlgo::HostReduce,
        Algo::Oneshot => CommAlgo::Oneshot,
        Algo::Twoshot => CommAlgo::Twoshot,
        Algo::Auto => unreachable!("resolve never returns auto"),
    }
}

pub struct Communicator<D: Device> {
    dev: Arc<D>,
    rank: usize,
    world: usize,
    backend: Backend,
    control: Arc<ControlBlock>,
    /// Every rank's communication buffer; ours at index `rank`.
    bufs: Vec<D::Buf>,
    layout: CommLayout,
    /// Non-empty allreduce calls so far (every algorithm, replays of captured graphs included);
    /// the next
    /// call uses `epoch + 1`. Identical on every rank because every rank makes the same calls
    /// in the same order.
    epoch: u32,
    timeout: Duration,
    spin: u32,
    default_algo: Algo,
}

impl<D: Device> Communicator<D> {
    /// Allocates and exports this rank's buffer, exchanges exports through the coordinator,
    /// maps every peer's buffer, and meets the others at the first barrier.
    pub fn establish(
        dev: Arc<D>,
        conn: &Conn,
        ctx: &RankCtx,
        backend: Backend,
        max_message_bytes: usize,
        timeout: Duration,
        spin: u32,
    ) -> Result<Self, RankError> {
        let (rank, control) = (ctx.rank, ctx.control.clone());
        let world = control.world();
        let layout = CommLayout::new(max_message_bytes, world);
        let (own, export) = dev.alloc_shared(layout.total_bytes())?;
        let info = dev.info();
        let item = ExportItem {
            meta: crate::job::encode(&export.meta),
            has_fd: export.fd.is_some(),
        };
        let fds: Vec<_> = export.fd.iter().map(std::os::fd::AsFd::as_fd).collect();
        // GPU ranks see their device as ordinal 0 (CUDA_VISIBLE_DEVICES); name the physical
        // device the coordinator assigned instead.
        let ordinal = ctx.device;
        conn.send(
            &Msg::Export {
                device: if info.name == info.backend {
                    format!("{}:{ordinal}", info.backend)
                } else {
                    format!("{}:{ordinal} ({})", info.backend, info.name)
                },
                device_uuid: info.uuid.clone(),
                items: vec![item],
            },
            &fds,
        )
        .map_err(|e| RankError::Other(format!("sending our buffer export: {e}")))?;
        drop(fds);
        let (msg, fds) = wait_for_peers(conn, &control, timeout)?;
        let Msg::Peers { items } = msg else {
            return Err(RankError::Other(format!("expected Peers, got {msg:?}")));
        };
        if items.len() != world {
            return Err(RankError::Other(format!(
                "got exports of {} ranks for a world of {world}",
                items.len()
            )));
        }
        let mut fds = fds.into_iter();
        let mut bufs = Vec::with_capacity(world);
        let mut own = Some(own);
        for (r, rank_items) in items.into_iter().enumerate() {
            let item = rank_items
                .into_iter()
                .next()
                .ok_or_else(|| RankError::Other(format!("rank {r} exported no buffer")))?;
            let fd = if item.has_fd {
                Some(fds.next().ok_or_else(|| {
                    RankError::Other(format!("rank {r}'s export came without its descriptor"))
                })?)
            } else {
                None
            };
            if r == rank {
                // Our own export came back too; we keep our original mapping.
                bufs.push(own.take().expect("own buffer is taken once"));
                continue;
            }
            let meta: ExportMeta = crate::job::decode(&item.meta)?;
            let buf = dev
                .import(Export { meta, fd })
                .map_err(|e| RankError::Other(format!("mapping rank {r}'s buffer: {e}")))?;
            bufs.push(buf);
        }
        let comm = Communicator {
            dev,
            rank,
            world,
            backend,
            control,
            bufs,
            layout,
            epoch: 0,
            timeout,
            spin,
            default_algo: Algo::Auto,
        };
        comm.barrier()?;
        Ok(comm)
    }

    pub fn set_default_algo(&mut self, algo: Algo) {
        self.default_algo = algo;
    }

    pub fn max_message_bytes(&self) -> usize {
        self.layout.data_bytes
    }

    /// Ends the job's collective work: waits until this rank's queued calls are done and
    /// every rank got here, so that no peer still reads our buffer (a call returns before
    /// its peers may have finished reading our slot) when it is freed. Call it on the success
    /// path, before dropping the communicator.
    pub fn close(&self) -> Result<(), RankError> {
        self.dev.sync()?;
        self.barrier()
    }

    /// A host barrier over the control block.
    pub fn barrier(&self) -> Result<(), RankError> {
        self.control
            .barrier(self.rank, self.timeout, self.spin)
            .map_err(RankError::from)
    }

    /// The algorithm a call with `algo` on `bytes` bytes runs.
    pub fn resolve(&self, algo: Algo, bytes: usize) -> Algo {
        match algo {
            Algo::Auto => auto_pick(self.backend, bytes, self.world),
            a => a,
        }
    }

    /// In-place allreduce of `data` with `algo`.
    pub fn allreduce_with(&mut self, algo: Algo, data: View<'_, D::Buf>) -> Result<(), RankError> {
        self.allreduce_then(algo, data, None)
    }

    /// In-place allreduce of `data` with `algo`, then the optional add + norm epilogue.
    fn allreduce_then(
        &mut self,
        algo: Algo,
        data: View<'_, D::Buf>,
        add_norm: Option<AddNorm<'_, D::Buf>>,
    ) -> Result<(), RankError> {
        if data.bytes() > self.layout.data_bytes {
            return Err(RankError::Other(format!(
                "allreduce of {} bytes exceeds the {}-byte communication buffer",
                data.bytes(),
                self.layout.data_bytes
            )));
        }
        if data.len == 0 && add_norm.is_none() {
            // Every rank makes the same calls, so every rank skips this one alike.
            return Ok(());
        }
        let algo = device_algo(self.resolve(algo, data.bytes()));
        let refs: Vec<&D::Buf> = self.bufs.iter().collect();
        // Like every call, slot epoch % 2: free, because every peer finished call epoch - 2
        // (its reads of this slot) before it signalled call epoch - 1, which we waited for
        // (flags, low-latency lines, or the barrier of a host call).
        self.epoch = self.epoch.wrapping_add(1);
        if algo == CommAlgo::HostReduce {
            // `host`: the copy into our slot, its sync and the barrier are the host's part.
            let slot = self.layout.slot_offset(self.epoch);
            let mine = View::new(refs[self.rank], slot, data.len, data.dtype);
            self.dev.run(&Op::Copy(tprun_kernels::ops::Copy {
                src: data,
                dst: mine,
            }))?;
            self.dev.sync()?;
            // Every rank's input is in its slot (the sync above finished the copy; the
            // barrier's AcqRel/Release chain publishes it to the readers).
            self.barrier()?;
            // The sum below is queued, not waited for: the result is stream-ordered before
            // whatever the caller queues next, and no closing barrier is needed. The next
            // call writes the other slot; the call after it (e + 2) writes this slot again
            // only after call e + 1's wait for every peer (its barrier, flags or low-latency
            // lines), which each peer passes or sends only once this reduce of its own has
            // finished (stream order). Before a buffer is freed, `close` waits for the peers.
        }
        let mut args = self.call_args(algo, self.epoch, data, &refs);
        args.add_norm = add_norm;
        self.dev.run(&Op::Allreduce(args))?;
        self.control.beat(self.rank);
        Ok(())
    }

    /// The arguments of one `Op::Allreduce` of `data` by this rank.
    fn call_args<'a>(
        &'a self,
        algo: CommAlgo,
        epoch: u32,
        data: View<'a, D::Buf>,
        comm: &'a [&'a D::Buf],
    ) -> AllreduceArgs<'a, D::Buf> {
        AllreduceArgs {
            algo,
            rank: self.rank,
            world: self.world,
            epoch,
            data,
            comm,
            layout: self.layout,
            timeout: self.timeout,
            abort: Some(self.control.abort_word()),
            add_norm: None,
        }
    }

    /// Captures one `algo` allreduce of `data` into a device graph and replays it `replays`
    /// times back to back; the time per replay, or `None` where the algorithm (`host`: it
    /// waits on the host) or the backend (CPU) cannot be captured. Every rank must call it
    /// with the same arguments: each replay is a collective call.
    pub fn graph_time(
        &mut self,
        algo: Algo,
        data: View<'_, D::Buf>,
        replays: u32,
    ) -> Result<Option<Duration>, RankError> {
        let algo = match device_algo(self.resolve(algo, data.bytes())) {
            CommAlgo::HostReduce => return Ok(None),
            a => a,
        };
        let refs: Vec<&D::Buf> = self.bufs.iter().collect();
        // The epoch is ignored while capturing: a replayed kernel takes its epoch from the
        // device-side counter, which every replay advances.
        let args = self.call_args(algo, self.epoch.wrapping_add(1), data, &refs);
        let t = self.dev.time_graph(replays, &mut || {
            self.dev.run(&Op::Allreduce(AllreduceArgs { ..args }))
        })?;
        if t.is_some() {
            // The device counter moved once per replay; the host's count follows it.
            self.epoch = self.epoch.wrapping_add(replays);
        }
        self.control.beat(self.rank);
        Ok(t)
    }
}

impl<D: Device> Collectives<D> for Communicator<D> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn allreduce(&mut self, data: View<'_, D::Buf>) -> Result<(), RankError> {
        self.allreduce_with(self.default_algo, data)
    }

    fn allreduce_add_norm(
        &mut self,
        data: View<'_, D::Buf>,
        add_norm: AddNorm<'_, D::Buf>,
    ) -> Result<(), RankError> {
        self.allreduce_then(self.default_algo, data, Some(add_norm))
    }

    fn epoch(&self) -> u32 {
        self.epoch
    }

    fn set_epoch(&mut self, epoch: u32) {
        self.epoch = epoch;
    }

    fn capturable(&self, bytes: usize) -> bool {
        self.resolve(self.default_algo, bytes) != Algo::Host
    }
}
