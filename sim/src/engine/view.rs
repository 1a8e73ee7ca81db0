//! Replaying an [`EventView`]: borrowed events read with their ids renamed and some sizes replaced
//! (a step written once standing for others), applied without a copy of any event.

use vramsim_traces::{renamed_id, EventView};

use super::{Flow, Replay, ReplayError};
use crate::allocator::Allocator;

impl<A: Allocator> Replay<A> {
    /// Applies `view`'s events, each integer id renamed as the view says, then moved by `shift`
    /// where it is (after renaming) at or above `shifted_from` — a repetition's own ids
    /// ([`super::Repeat`]); `shift` 0 moves nothing.
    pub(super) fn apply_shifted(
        &mut self,
        view: &EventView,
        shifted_from: u64,
        shift: u64,
    ) -> Result<Flow, ReplayError> {
        let renames = view.renames;
        let rename = |id: u64| {
            let id = renamed_id(id, renames);
            if id >= shifted_from {
                id + shift
            } else {
                id
            }
        };
        for (event, size) in view.sized() {
            let flow = if renames.is_empty() && shift == 0 {
                self.apply_as(event, |id| id, size)?
            } else {
                self.apply_as(event, rename, size)?
            };
            if flow == Flow::Stopped {
                return Ok(Flow::Stopped);
            }
        }
        Ok(Flow::Continue)
    }
}
