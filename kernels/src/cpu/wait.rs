//! Waiting on a 32-bit word in shared memory: spin briefly, then sleep on a futex.
//!
//! The futex is the shared (not `FUTEX_PRIVATE`) kind, because the word lives in a memfd mapped
//! by several processes: private futexes are keyed by address space and would never wake a
//! peer process.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rustix::thread::futex;

/// The longest single futex sleep; between sleeps the abort word is checked, so this bounds how
/// long an aborted job takes to notice (the coordinator also wakes waiters when it aborts).
pub const MAX_SLEEP: Duration = Duration::from_millis(20);

/// Why a wait ended without its condition becoming true.
#[derive(Debug, PartialEq, Eq)]
pub enum WaitError {
    TimedOut,
    Aborted,
}

/// Waits until `done(word.load(Acquire))` holds.
///
/// Spins `spin` times first (cheap when the other side is running on another core), then
/// sleeps on the futex until woken or `MAX_SLEEP` passes, checking `abort` and `deadline`
/// between sleeps. The Acquire load pairs with the writer's Release store (or RMW) of the
/// word: everything the writer did before it is visible once `done` holds.
pub fn wait_until(
    word: &AtomicU32,
    done: impl Fn(u32) -> bool,
    spin: u32,
    deadline: Instant,
    abort: Option<&AtomicU32>,
) -> Result<(), WaitError> {
    for _ in 0..spin {
        if done(word.load(Ordering::Acquire)) {
            return Ok(());
        }
        std::hint::spin_loop();
    }
    loop {
        let seen = word.load(Ordering::Acquire);
        if done(seen) {
            return Ok(());
        }
        // Relaxed: the abort word publishes no data, only "stop"; the reason is read with
        // its own Acquire load by whoever reports it.
        if abort.is_some_and(|a| a.load(Ordering::Relaxed) != 0) {
            return Err(WaitError::Aborted);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(WaitError::TimedOut);
        }
        let nap = (deadline - now).min(MAX_SLEEP);
        let ts = rustix::time::Timespec {
            tv_sec: nap.as_secs() as i64,
            tv_nsec: nap.subsec_nanos() as i64,
        };
        // Sleeps only if the word still equals `seen` (the kernel re-checks atomically), so a
        // store + wake between our load and this call is never missed. EAGAIN, EINTR and
        // ETIMEDOUT all just mean "look again".
        let _ = futex::wait(word, futex::Flags::empty(), seen, Some(&ts));
    }
}

/// Wakes every process sleeping on `word` (call after the Release store that changed it).
pub fn wake_all(word: &AtomicU32) {
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}

/// True once the epoch counter `flag` has reached `epoch`, allowing for wrap-around.
#[inline]
pub fn reached(flag: u32, epoch: u32) -> bool {
    (flag.wrapping_sub(epoch) as i32) >= 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn reached_handles_wraparound() {
        assert!(reached(5, 5));
        assert!(reached(6, 5));
        assert!(!reached(4, 5));
        assert!(reached(1, u32::MAX));
        assert!(!reached(u32::MAX, 1));
    }

    #[test]
    fn wait_wakes_on_store_and_times_out_otherwise() {
        let w = Arc::new(AtomicU32::new(0));
        let w2 = w.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            w2.store(7, Ordering::Release);
            wake_all(&w2);
        });
        let dl = Instant::now() + Duration::from_secs(5);
        assert_eq!(wait_until(&w, |v| v == 7, 10, dl, None), Ok(()));
        t.join().unwrap();
        let dl = Instant::now() + Duration::from_millis(30);
        assert_eq!(
            wait_until(&w, |v| v == 8, 10, dl, None),
            Err(WaitError::TimedOut)
        );
        let abort = AtomicU32::new(1);
        assert_eq!(
            wait_until(
                &w,
                |v| v == 8,
                10,
                dl + Duration::from_secs(5),
                Some(&abort)
            ),
            Err(WaitError::Aborted)
        );
    }
}
