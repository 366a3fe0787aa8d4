//! The control block: one memfd that the coordinator creates and every rank maps.
//!
//! It holds only atomics, each group in its own `CachePadded` slot (128 bytes on x86-64,
//! crossbeam's choice for adjacent-line prefetching) so that ranks writing their own slots
//! never contend for a cache line:
//!
//! - header: magic, layout version, world size, token hash (written once before sharing);
//! - abort word: 0 while running, else `reason << 16 | (rank + 1)` (rank 0 = none), set once;
//! - barrier: arrival count and generation (sense reversal by generation number);
//! - per-rank slots: pid, phase, heartbeat, error code, barriers arrived at;
//! - token ring: rank 0 appends generated token ids, each tagged with its sequence (serve's
//!   request), the coordinator consumes them;
//! - serve's step plan: before each batched step rank 0 publishes which requests join and
//!   leave the batch; every rank reads it (and acknowledges it in its slot) before the step.
//!
//! Every wait here has a deadline and checks the abort word.

use std::mem::{offset_of, size_of};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use memmap2::MmapRaw;
use rustix::thread::futex;

use crate::{IpcError, Result};

/// Largest world the control block has slots for (matches the communication layout).
pub const MAX_RANKS: usize = 64;
/// Token ring capacity; rank 0 waits when the coordinator falls this far behind.
pub const RING: usize = 4096;
/// Most entries of one step plan.
pub const PLAN_MAX: usize = 256;
const MAGIC: u64 = u64::from_le_bytes(*b"TPRUNCB1");
const LAYOUT_VERSION: u32 = 3;
/// Longest single futex sleep, so that deadlines and the abort word are checked regularly even
/// if a wake-up is lost to a dying process.
const MAX_SLEEP: Duration = Duration::from_millis(20);

#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    world: AtomicU32,
    token_hash: AtomicU64,
}

#[repr(C)]
struct RankSlot {
    pid: AtomicU32,
    /// The rank's current phase, for error messages: a code whose meaning belongs to the
    /// ranks (an index into [`ControlBlock::with_phase_names`]); 0 in a fresh slot.
    phase: AtomicU32,
    /// Bumped by the rank whenever it makes progress; the coordinator's stall detector reads it.
    heartbeat: AtomicU64,
    /// Non-zero once the rank has failed (its own code; the message goes over the socket).
    error: AtomicU32,
    /// Number of barriers this rank has arrived at: who is missing from a barrier that times
    /// out is whoever has arrived at fewer than the waiter.
    arrivals: AtomicU32,
    /// The last step plan this rank has read (serve).
    plan_ack: AtomicU64,
}

#[repr(C)]
struct BatchWords {
    /// Batched steps run, and the rows (sequences) they ran in all.
    steps: AtomicU64,
    rows: AtomicU64,
    /// Sequences in the batch now, and the most there have been.
    size: AtomicU64,
    peak: AtomicU64,
}

/// Rank 0's batch statistics ([`ControlBlock::batch_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchStats {
    pub steps: u64,
    pub rows: u64,
    pub size: u64,
    pub peak: u64,
}

#[repr(C)]
struct Shared {
    header: CachePadded<Header>,
    abort: CachePadded<AtomicU32>,
    barrier_count: CachePadded<AtomicU32>,
    barrier_gen: CachePadded<AtomicU32>,
    slots: [CachePadded<RankSlot>; MAX_RANKS],
    /// Tokens appended so far (rank 0 writes, Release).
    ring_head: CachePadded<AtomicU64>,
    /// Tokens consumed so far (coordinator writes, Release).
    ring_tail: CachePadded<AtomicU64>,
    /// `serve`: the number of the step whose plan `plan` holds (0: none yet). Written after
    /// the entries and their count (Release).
    plan_seq: CachePadded<AtomicU64>,
    plan_len: CachePadded<AtomicU32>,
    plan: [AtomicU64; PLAN_MAX],
    /// `serve`: rank 0's batch statistics, for the coordinator's metrics.
    batch: CachePadded<BatchWords>,
    /// `tag << 32 | token`.
    ring: [AtomicU64; RING],
}

// The layout is shared between processes of the same build only (the protocol version and the
// header's layout version guard that), but keep it fixed and cache-line aligned regardless.
const _: () = {
    assert!(offset_of!(Shared, header) == 0);
    assert!(offset_of!(Shared, abort).is_multiple_of(64));
    assert!(offset_of!(Shared, barrier_gen).is_multiple_of(64));
    assert!(offset_of!(Shared, slots).is_multiple_of(64));
    assert!(size_of::<CachePadded<RankSlot>>().is_multiple_of(64));
    assert!(offset_of!(Shared, ring).is_multiple_of(64));
    assert!(size_of::<Shared>() < 1 << 20);
};

/// Why a job was aborted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum AbortReason {
    /// A rank exited, died or reported an error.
    RankFailed = 1,
    /// A wait ran past its deadline.
    Timeout = 2,
    /// The coordinator was interrupted (Ctrl-C, SIGTERM).
    Interrupted = 3,
}

impl AbortReason {
    fn from_u32(v: u32) -> AbortReason {
        match v {
            2 => AbortReason::Timeout,
            3 => AbortReason::Interrupted,
            _ => AbortReason::RankFailed,
        }
    }
}

/// FNV-1a of the job token: lets a rank check it mapped this job's block without putting the
/// token itself in shared memory.
fn token_hash(token: &[u8; 16]) -> u64 {
    token.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A mapped control block.
pub struct ControlBlock {
    map: MmapRaw,
    fd: OwnedFd,
    world: usize,
    /// Names of the phase codes, for messages; given by whoever knows the phases (the rank
    /// crate), since this crate knows nothing of what ranks do.
    phase_names: &'static [&'static str],
}

// SAFETY: the mapping contains only atomics, accessed through `&Shared`.
unsafe impl Send for ControlBlock {}
// SAFETY: as above.
unsafe impl Sync for ControlBlock {}

impl ControlBlock {
    /// Creates a new block for `world` ranks (coordinator side).
    pub fn create(world: usize, token: &[u8; 16]) -> Result<ControlBlock> {
        if world == 0 || world > MAX_RANKS {
            return Err(IpcError::Protocol(format!(
                "world size {world} is outside 1..={MAX_RANKS}"
            )));
        }
        let fd =
            nix::sys::memfd::memfd_create(c"tprun-control", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
                .map_err(|e| IpcError::os("memfd_create for the control block", e))?;
        nix::unistd::ftruncate(&fd, size_of::<Shared>() as i64)
            .map_err(|e| IpcError::os("sizing the control block", e))?;
        let cb = Self::map(fd, world)?;
        let h = &cb.shared().header;
        // Relaxed: the block is not shared yet; the fd reaches ranks through the socket, and
        // sendmsg/recvmsg order these stores before any rank's loads.
        h.version.store(LAYOUT_VERSION, Ordering::Relaxed);
        h.world.store(world as u32, Ordering::Relaxed);
        h.token_hash.store(token_hash(token), Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok(cb)
    }

    /// Maps a block received from the coordinator and checks that it belongs to this job.
    pub fn open(fd: OwnedFd, world: usize, token: &[u8; 16]) -> Result<ControlBlock> {
        // The world comes from the coordinator's Welcome; every slot index below it must be one
        // of the block's MAX_RANKS slots, whatever a forged header agrees to.
        if world == 0 || world > MAX_RANKS {
            return Err(IpcError::Protocol(format!(
                "world size {world} is outside 1..={MAX_RANKS}"
            )));
        }
        let size = nix::sys::stat::fstat(fd.as_fd())
            .map_err(|e| IpcError::os("fstat of the control block", e))?
            .st_size as usize;
        if size < size_of::<Shared>() {
            return Err(IpcError::Protocol(format!(
                "control block is {size} bytes, expected {}",
                size_of::<Shared>()
            )));
        }
        let cb = Self::map(fd, world)?;
        let h = &cb.shared().header;
        // Acquire pairs with the Release store of the magic in `create`.
        let ok = h.magic.load(Ordering::Acquire) == MAGIC
            && h.version.load(Ordering::Relaxed) == LAYOUT_VERSION
            && h.world.load(Ordering::Relaxed) as usize == world
            && h.token_hash.load(Ordering::Relaxed) == token_hash(token);
        if !ok {
            return Err(IpcError::Protocol(
                "the control block does not belong to this job".into(),
            ));
        }
        Ok(cb)
    }

    fn map(fd: OwnedFd, world: usize) -> Result<ControlBlock> {
        let map = memmap2::MmapOptions::new()
            .len(size_of::<Shared>())
            .map_raw(&fd)
            .map_err(|e| IpcError::os("mapping the control block", e))?;
        Ok(ControlBlock {
            map,
            fd,
            world,
            phase_names: &[],
        })
    }

    /// Names phase code `i` `names[i]` in this process's messages (barrier timeouts,
    /// [`ControlBlock::phase_name`]). Without names, a phase reads as "phase <code>".
    pub fn with_phase_names(mut self, names: &'static [&'static str]) -> Self {
        self.phase_names = names;
        self
    }

    fn shared(&self) -> &Shared {
        // SAFETY: the mapping is at least size_of::<Shared>() bytes (checked in `open`, sized in
        // `create`), page-aligned, and Shared is all atomics, for which any bit pattern
        // (zeroed memory included) is valid. It lives as long as `self`.
        unsafe { &*(self.map.as_ptr() as *const Shared) }
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn world(&self) -> usize {
        self.world
    }

    // ---- abort word -------------------------------------------------------------------------

    /// Aborts the job (first caller wins) and wakes every barrier sleeper. Returns false if the
    /// job was already aborted.
    pub fn abort(&self, reason: AbortReason, rank: Option<usize>) -> bool {
        let code = (reason as u32) << 16 | rank.map_or(0, |r| r as u32 + 1);
        let s = self.shared();
        // AcqRel: the first abort wins; publishing nothing else, but keeps the order with the
        // wake below.
        let won = s
            .abort
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        // Bump the barrier generation's futex waiters awake; they re-check the abort word.
        let _ = futex::wake(&s.barrier_gen, futex::Flags::empty(), i32::MAX as u32);
        won
    }

    /// The abort reason and the rank that caused it, if the job was aborted.
    pub fn aborted(&self) -> Option<(AbortReason, Option<usize>)> {
        let v = self.shared().abort.load(Ordering::Acquire);
        (v != 0).then(|| {
            let r = v & 0xffff;
            (
                AbortReason::from_u32(v >> 16),
                (r != 0).then(|| r as usize - 1),
            )
        })
    }

    /// The raw abort word, for waits in other layers (the CPU backend's flag waits).
    pub fn abort_word(&self) -> &AtomicU32 {
        &self.shared().abort
    }

    // ---- per-rank slots ---------------------------------------------------------------------

    fn slot(&self, rank: usize) -> &RankSlot {
        &self.shared().slots[rank]
    }

    pub fn set_pid(&self, rank: usize, pid: u32) {
        // Relaxed: diagnostic only.
        self.slot(rank).pid.store(pid, Ordering::Relaxed);
    }

    /// Records that `rank` entered the phase with code `phase`.
    pub fn set_phase(&self, rank: usize, phase: u32) {
        // Relaxed: diagnostic; read by the coordinator only to name the phase in an error.
        self.slot(rank).phase.store(phase, Ordering::Relaxed);
        self.beat(rank);
    }

    /// The code of `rank`'s current phase (0 until it sets one).
    pub fn phase(&self, rank: usize) -> u32 {
        self.slot(rank).phase.load(Ordering::Relaxed)
    }

    /// The name of `rank`'s current phase (see [`ControlBlock::with_phase_names`]).
    pub fn phase_name(&self, rank: usize) -> String {
        let code = self.phase(rank);
        match self.phase_names.get(code as usize) {
            Some(name) => (*name).to_string(),
            None => format!("phase {code}"),
        }
    }

    /// Records progress (the coordinator's stall detector watches this).
    pub fn beat(&self, rank: usize) {
        // Relaxed: a counter whose only use is "did it change".
        self.slot(rank).heartbeat.fetch_add(1, Ordering::Relaxed);
    }

    pub fn heartbeat(&self, rank: usize) -> u64 {
        self.slot(rank).heartbeat.load(Ordering::Relaxed)
    }

    pub fn set_error(&self, rank: usize, code: u32) {
        self.slot(rank).error.store(code, Ordering::Relaxed);
    }

    pub fn error(&self, rank: usize) -> u32 {
        self.slot(rank).error.load(Ordering::Relaxed)
    }

    // ---- barrier ----------------------------------------------------------------------------

    /// Waits until all `world` ranks have called `barrier`, or the deadline passes, or the job
    /// is aborted. Spins `spin` times before sleeping on the generation futex.
    ///
    /// Sense reversal by generation: read the generation, then arrive; the last to arrive
    /// resets the count and bumps the generation; the others wait for the generation to change.
    pub fn barrier(&self, rank: usize, timeout: Duration, spin: u32) -> Result<()> {
        let s = self.shared();
        let deadline = Instant::now() + timeout;
        // Acquire: pairs with the Release bump below by the previous barrier's last arriver,
        // so our arrival is counted against the current generation. Must be read before we
        // arrive: if we read it after, the last arriver could already have bumped it and we
        // would wait for a generation that never comes.
        let gen = s.barrier_gen.load(Ordering::Acquire);
        let mine = self.slot(rank).arrivals.fetch_add(1, Ordering::Relaxed) + 1;
        self.beat(rank);
        // AcqRel: the last arriver acquires every other rank's writes made before its arrival
        // (their Release half) and republishes them with the generation's Release store.
        if s.barrier_count.fetch_add(1, Ordering::AcqRel) + 1 == self.world as u32 {
            // Relaxed is enough for the reset: nobody can arrive at the next barrier before
            // seeing the new generation, which is stored after this with Release.
            s.barrier_count.store(0, Ordering::Relaxed);
            s.barrier_gen.store(gen.wrapping_add(1), Ordering::Release);
            let _ = futex::wake(&s.barrier_gen, futex::Flags::empty(), i32::MAX as u32);
            return Ok(());
        }
        let mut spins = 0u32;
        loop {
            // Acquire: see everything every rank did before arriving (via the last arriver).
            let g = s.barrier_gen.load(Ordering::Acquire);
            if g != gen {
                return Ok(());
            }
            if let Some((reason, who)) = self.aborted() {
                return Err(IpcError::Aborted(describe_abort(reason, who)));
            }
            if spins < spin {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = (0..self.world)
                    .filter(|&r| self.slot(r).arrivals.load(Ordering::Relaxed) < mine)
                    .collect();
                return Err(IpcError::BarrierTimeout {
                    waited: timeout,
                    phase: self.phase_name(rank),
                    missing,
                });
            }
            let nap = (deadline - now).min(MAX_SLEEP);
            let ts = rustix::time::Timespec {
                tv_sec: nap.as_secs() as i64,
                tv_nsec: nap.subsec_nanos() as i64,
            };
            // Sleeps only while the generation still equals `gen` (checked atomically by the
            // kernel), so a bump between our load and this call is not missed.
            let _ = futex::wait(&s.barrier_gen, futex::Flags::empty(), gen, Some(&ts));
        }
    }

    // ---- token ring -------------------------------------------------------------------------

    /// Appends `token` of sequence `tag` (rank 0), waiting while the ring is full.
    pub fn push_token(&self, tag: u32, token: u32, timeout: Duration) -> Result<()> {
        let s = self.shared();
        // Relaxed: only this rank writes the head.
        let head = s.ring_head.load(Ordering::Relaxed);
        let deadline = Instant::now() + timeout;
        // Acquire: pairs with the coordinator's Release store of the tail, so the slot we are
        // about to overwrite has been read.
        while head - s.ring_tail.load(Ordering::Acquire) >= RING as u64 {
            if let Some((r, w)) = self.aborted() {
                return Err(IpcError::Aborted(describe_abort(r, w)));
            }
            if Instant::now() >= deadline {
                return Err(IpcError::Timeout(timeout));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let word = (tag as u64) << 32 | token as u64;
        s.ring[(head % RING as u64) as usize].store(word, Ordering::Relaxed);
        // Release: publishes the token store above to the coordinator's Acquire load of head.
        s.ring_head.store(head + 1, Ordering::Release);
        Ok(())
    }

    /// Moves every (tag, token) appended since the last call into `out` (coordinator).
    pub fn pop_tokens(&self, out: &mut Vec<(u32, u32)>) {
        let s = self.shared();
        // Acquire: pairs with push_token's Release store of head: the tokens are visible.
        let head = s.ring_head.load(Ordering::Acquire);
        let mut tail = s.ring_tail.load(Ordering::Relaxed);
        while tail < head {
            let w = s.ring[(tail % RING as u64) as usize].load(Ordering::Relaxed);
            out.push(((w >> 32) as u32, w as u32));
            tail += 1;
        }
        // Release: our reads of the slots happen before rank 0 may overwrite them.
        s.ring_tail.store(tail, Ordering::Release);
    }

    // ---- serve's step plan ----------------------------------------------------------------

    /// Rank 0: publishes the plan of step `seq` (> the last one; at most [`PLAN_MAX`]
    /// entries, whose meaning belongs to the ranks). Call only once every rank has read the
    /// previous plan ([`ControlBlock::plan_read_by_all`]): there is one plan at a time.
    pub fn publish_plan(&self, seq: u64, entries: &[u64]) {
        let s = self.shared();
        assert!(
            entries.len() <= PLAN_MAX,
            "a plan of {} entries",
            entries.len()
        );
        for (slot, &e) in s.plan.iter().zip(entries) {
            slot.store(e, Ordering::Relaxed);
        }
        s.plan_len.store(entries.len() as u32, Ordering::Relaxed);
        // Release: the entries and their count above are visible to whoever sees `seq`.
        s.plan_seq.store(seq, Ordering::Release);
    }

    /// The plan of step `seq`, once rank 0 has published it (then recorded as read by
    /// `rank`); `None` before.
    pub fn read_plan(&self, rank: usize, seq: u64) -> Option<Vec<u64>> {
        let s = self.shared();
        if s.plan_seq.load(Ordering::Acquire) != seq {
            return None;
        }
        let n = (s.plan_len.load(Ordering::Relaxed) as usize).min(PLAN_MAX);
        let plan = s.plan[..n]
            .iter()
            .map(|e| e.load(Ordering::Relaxed))
            .collect();
        // Release: our reads above happen before rank 0, seeing the ack, overwrites them.
        s.slots[rank].plan_ack.store(seq, Ordering::Release);
        Some(plan)
    }

    /// Rank 0: a step of `rows` sequences just ran (0: none), and the batch now holds
    /// `size`.
    pub fn record_batch(&self, rows: usize, size: usize) {
        let b = &self.shared().batch;
        if rows > 0 {
            // Rows before the step (Release): a reader that sees the step sees its rows.
            b.rows.fetch_add(rows as u64, Ordering::Relaxed);
            b.steps.fetch_add(1, Ordering::Release);
        }
        b.size.store(size as u64, Ordering::Relaxed);
        b.peak.fetch_max(rows.max(size) as u64, Ordering::Relaxed);
    }

    /// Rank 0's batch statistics so far (coordinator).
    pub fn batch_stats(&self) -> BatchStats {
        let b = &self.shared().batch;
        let steps = b.steps.load(Ordering::Acquire);
        BatchStats {
            steps,
            rows: b.rows.load(Ordering::Relaxed),
            size: b.size.load(Ordering::Relaxed),
            peak: b.peak.load(Ordering::Relaxed),
        }
    }

    /// Whether every rank has read the plan of step `seq` (rank 0, before publishing the
    /// next one).
    pub fn plan_read_by_all(&self, seq: u64) -> bool {
        let s = self.shared();
        (1..self.world).all(|r| s.slots[r].plan_ack.load(Ordering::Acquire) >= seq)
    }

    /// Rank 0: publishes the plan of step `seq` once every rank has read step `seq - 1`'s
    /// (one plan at a time), waiting at most `timeout` (then the ranks that have not read it
    /// are named, as at a barrier) or until the job is aborted.
    pub fn publish_plan_when_read(
        &self,
        seq: u64,
        entries: &[u64],
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut naps = 0u32;
        while !self.plan_read_by_all(seq - 1) {
            if let Some((reason, who)) = self.aborted() {
                return Err(IpcError::Aborted(describe_abort(reason, who)));
            }
            if Instant::now() > deadline {
                let s = self.shared();
                let missing = (1..self.world)
                    .filter(|&r| s.slots[r].plan_ack.load(Ordering::Acquire) < seq - 1)
                    .collect();
                return Err(IpcError::BarrierTimeout {
                    waited: timeout,
                    phase: format!("{} (reading step {}'s plan)", self.phase_name(0), seq - 1),
                    missing,
                });
            }
            plan_nap(&mut naps);
        }
        self.publish_plan(seq, entries);
        Ok(())
    }

    /// Every rank but 0: the plan of step `seq`, waiting as long as it takes (an idle server
    /// publishes none) but not past an abort. Beats `rank`'s heartbeat while it waits, and
    /// calls `idle` once when the wait has outlasted a step's (then the rank is idle, not
    /// stepping).
    pub fn wait_plan(&self, rank: usize, seq: u64, mut idle: impl FnMut()) -> Result<Vec<u64>> {
        let mut naps = 0u32;
        let mut beat = Instant::now();
        loop {
            if let Some(p) = self.read_plan(rank, seq) {
                return Ok(p);
            }
            if let Some((reason, who)) = self.aborted() {
                return Err(IpcError::Aborted(describe_abort(reason, who)));
            }
            if naps == 1000 {
                idle();
            }
            if beat.elapsed() > Duration::from_millis(250) {
                self.beat(rank);
                beat = Instant::now();
            }
            plan_nap(&mut naps);
        }
    }
}

/// A plan wait's pause: spinning at first (a step's plan comes within microseconds), then
/// sleeping longer and longer, up to 1 ms (an idle server).
fn plan_nap(naps: &mut u32) {
    *naps = naps.saturating_add(1);
    match *naps {
        0..=200 => std::hint::spin_loop(),
        n => std::thread::sleep(Duration::from_micros((n as u64 / 8).min(1000))),
    }
}

/// "rank 2 failed", "a timeout", …: for error messages of ranks that see the abort.
pub fn describe_abort(reason: AbortReason, rank: Option<usize>) -> String {
    let who = rank.map_or(String::new(), |r| format!(" (rank {r})"));
    match reason {
        AbortReason::RankFailed => format!("a rank failed{who}"),
        AbortReason::Timeout => format!("a timeout{who}"),
        AbortReason::Interrupted => "interrupted".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::sync::Arc;

    fn open_clone(cb: &ControlBlock, token: &[u8; 16]) -> ControlBlock {
        let fd = cb.fd().try_clone_to_owned().unwrap();
        ControlBlock::open(fd, cb.world(), token).unwrap()
    }

    #[test]
    fn barrier_releases_all_and_repeats() {
        let token = [7u8; 16];
        let cb = ControlBlock::create(4, &token).unwrap();
        let views: Vec<Arc<ControlBlock>> =
            (0..4).map(|_| Arc::new(open_clone(&cb, &token))).collect();
        let counter = Arc::new(AtomicU32::new(0));
        let hs: Vec<_> = (0..4)
            .map(|r| {
                let v = views[r].clone();
                let c = counter.clone();
                std::thread::spawn(move || {
                    for round in 0..200u32 {
                        c.fetch_add(1, Ordering::Relaxed);
                        v.barrier(r, Duration::from_secs(10), 50).unwrap();
                        // After the barrier every rank's increment of this round is visible.
                        assert!(c.load(Ordering::Relaxed) >= (round + 1) * 4);
                        v.barrier(r, Duration::from_secs(10), 50).unwrap();
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    }

    #[test]
    fn barrier_timeout_names_missing_ranks_and_abort_wakes() {
        let token = [1u8; 16];
        let cb = ControlBlock::create(3, &token)
            .unwrap()
            .with_phase_names(&["start-up", "work"]);
        cb.set_phase(0, 1);
        match cb.barrier(0, Duration::from_millis(50), 10) {
            Err(IpcError::BarrierTimeout { missing, phase, .. }) => {
                assert_eq!(missing, vec![1, 2]);
                assert_eq!(phase, "work");
            }
            other => panic!("{other:?}"),
        }
        // Codes without a name still read as something.
        cb.set_phase(1, 7);
        assert_eq!(cb.phase_name(1), "phase 7");
        assert_eq!(cb.phase_name(2), "start-up");
        let cb2 = Arc::new(open_clone(&cb, &token));
        let c = cb2.clone();
        let h = std::thread::spawn(move || c.barrier(1, Duration::from_secs(30), 10));
        std::thread::sleep(Duration::from_millis(30));
        assert!(cb.abort(AbortReason::RankFailed, Some(2)));
        assert!(!cb.abort(AbortReason::Timeout, None), "first abort wins");
        assert!(matches!(h.join().unwrap(), Err(IpcError::Aborted(_))));
        assert_eq!(cb2.aborted(), Some((AbortReason::RankFailed, Some(2))));
    }

    #[test]
    fn open_rejects_another_jobs_block() {
        let cb = ControlBlock::create(2, &[1; 16]).unwrap();
        let fd = cb.fd().try_clone_to_owned().unwrap();
        assert!(ControlBlock::open(fd, 2, &[2; 16]).is_err());
        let fd = cb.fd().as_fd().try_clone_to_owned().unwrap();
        assert!(ControlBlock::open(fd, 3, &[1; 16]).is_err());
        // A forged header that agrees with a world beyond the slots is refused all the same.
        let token = [4u8; 16];
        let mut header = MAGIC.to_le_bytes().to_vec();
        header.extend_from_slice(&LAYOUT_VERSION.to_le_bytes());
        header.extend_from_slice(&(MAX_RANKS as u32 + 1).to_le_bytes());
        header.extend_from_slice(&token_hash(&token).to_le_bytes());
        let fd =
            nix::sys::memfd::memfd_create(c"forged", nix::sys::memfd::MFdFlags::empty()).unwrap();
        let mut f = std::fs::File::from(fd);
        std::io::Write::write_all(&mut f, &header).unwrap();
        f.set_len(size_of::<Shared>() as u64).unwrap();
        match ControlBlock::open(f.into(), MAX_RANKS + 1, &token) {
            Err(IpcError::Protocol(m)) => assert!(m.contains("world size 65"), "{m}"),
            other => panic!("{:?}", other.map(|c| c.world())),
        }
    }

    /// A plan is seen only by the step it is for, and rank 0 learns when every rank has
    /// read it.
    #[test]
    fn a_step_plan_reaches_every_rank_once_published() {
        let token = [7u8; 16];
        let cb = ControlBlock::create(3, &token).unwrap();
        let other = open_clone(&cb, &token);
        assert_eq!(other.read_plan(1, 1), None);
        cb.publish_plan(1, &[5, 1 << 63 | 9]);
        assert_eq!(other.read_plan(1, 2), None);
        assert!(!cb.plan_read_by_all(1));
        assert_eq!(other.read_plan(1, 1), Some(vec![5, 1 << 63 | 9]));
        assert!(!cb.plan_read_by_all(1), "rank 2 has not read it");
        assert_eq!(other.read_plan(2, 1), Some(vec![5, 1 << 63 | 9]));
        assert!(cb.plan_read_by_all(1));
        cb.publish_plan(2, &[]);
        assert_eq!(other.read_plan(2, 2), Some(vec![]));
        other.record_batch(3, 3);
        other.record_batch(0, 2);
        other.record_batch(2, 2);
        let want = BatchStats {
            steps: 2,
            rows: 5,
            size: 2,
            peak: 3,
        };
        assert_eq!(cb.batch_stats(), want);
    }

    /// The waiting forms: rank 0 names the rank that has not read the last plan when its
    /// wait times out, a waiting rank gets the plan once published (calling `idle` once
    /// while it waits long), and an abort ends both waits.
    #[test]
    fn plan_waits_end_on_publication_timeout_or_abort() {
        let token = [9u8; 16];
        let cb = ControlBlock::create(3, &token).unwrap();
        let other = open_clone(&cb, &token);
        cb.publish_plan_when_read(1, &[4], Duration::from_millis(10))
            .unwrap();
        assert_eq!(other.read_plan(1, 1), Some(vec![4]));
        match cb.publish_plan_when_read(2, &[5], Duration::from_millis(20)) {
            Err(IpcError::BarrierTimeout { missing, .. }) => assert_eq!(missing, vec![2]),
            r => panic!("{r:?}"),
        }
        assert_eq!(
            other.read_plan(2, 2),
            None,
            "not published after the timeout"
        );
        assert_eq!(other.read_plan(2, 1), Some(vec![4]));
        let waiter = std::thread::spawn(move || {
            let mut idles = 0;
            let plan = other.wait_plan(1, 2, || idles += 1);
            (plan.unwrap(), idles, other)
        });
        // Long past the ~60 ms of spins and naps after which the waiter calls itself idle.
        std::thread::sleep(Duration::from_millis(1000));
        cb.publish_plan_when_read(2, &[6, 7], Duration::from_secs(5))
            .unwrap();
        let (plan, idles, other) = waiter.join().unwrap();
        assert_eq!((plan, idles), (vec![6, 7], 1));
        cb.abort(AbortReason::RankFailed, Some(2));
        assert!(matches!(
            other.wait_plan(2, 3, || {}),
            Err(IpcError::Aborted(_))
        ));
        assert!(matches!(
            cb.publish_plan_when_read(3, &[], Duration::from_secs(5)),
            Err(IpcError::Aborted(_))
        ));
    }

    #[test]
    fn token_ring_carries_tokens_in_order_past_wraparound() {
        let token = [3u8; 16];
        let cb = ControlBlock::create(1, &token).unwrap();
        let rank0 = open_clone(&cb, &token);
        let mut got = Vec::new();
        for t in 0..(RING as u32 * 2 + 5) {
            rank0.push_token(t % 3, t, Duration::from_secs(1)).unwrap();
            if t % 1000 == 999 {
                cb.pop_tokens(&mut got);
            }
        }
        cb.pop_tokens(&mut got);
        let want: Vec<(u32, u32)> = (0..(RING as u32 * 2 + 5)).map(|t| (t % 3, t)).collect();
        assert_eq!(got, want);
        // A full ring times out instead of overwriting unread tokens.
        for t in 0..RING as u32 {
            rank0
                .push_token(u32::MAX, t, Duration::from_secs(1))
                .unwrap();
        }
        assert!(matches!(
            rank0.push_token(0, 0, Duration::from_millis(10)),
            Err(IpcError::Timeout(_))
        ));
    }
}
