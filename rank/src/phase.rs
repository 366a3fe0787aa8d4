//! The phases of a rank's life. The control block stores only a phase's code (ipc knows nothing
//! of what ranks do); the names here are what error messages ("rank 2 ... during decode") and
//! `TPRUN_FAULT=<kind>:<rank>:<phase>` (README) use, so they must not change lightly.

/// What a rank is doing, recorded in its control-block slot for error messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Phase {
    /// Before the rank has joined (also what a fresh control-block slot reads as).
    Starting = 0,
    Rendezvous = 1,
    Setup = 2,
    Allreduce = 3,
    Loading = 4,
    Prefill = 5,
    Decode = 6,
    Finishing = 7,
    /// `selftest`'s kernel checks.
    Selftest = 8,
    /// `serve`: waiting for the next request.
    Idle = 9,
}

impl Phase {
    /// Every phase, in code order.
    pub const ALL: [Phase; 10] = [
        Phase::Starting,
        Phase::Rendezvous,
        Phase::Setup,
        Phase::Allreduce,
        Phase::Loading,
        Phase::Prefill,
        Phase::Decode,
        Phase::Finishing,
        Phase::Selftest,
        Phase::Idle,
    ];

    /// The name of each code (`NAMES[p.code()]`), for the control block's messages
    /// (`ControlBlock::with_phase_names`).
    pub const NAMES: [&'static str; 10] = [
        "start-up",
        "rendezvous",
        "setup",
        "allreduce",
        "loading",
        "prefill",
        "decode",
        "finishing",
        "selftest",
        "idle",
    ];

    /// The code stored in the control block.
    pub fn code(self) -> u32 {
        self as u32
    }

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

// A zeroed control-block slot must read as "start-up".
const _: () = assert!(Phase::Starting as u32 == 0);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_index_their_names() {
        for (i, p) in Phase::ALL.into_iter().enumerate() {
            assert_eq!(p.code() as usize, i);
        }
        assert_eq!(Phase::Decode.name(), "decode");
        assert_eq!(Phase::Starting.name(), "start-up");
    }
}
