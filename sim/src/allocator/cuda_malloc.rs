//! No caching: every allocation is its own device allocation (SKELETON: being written).
