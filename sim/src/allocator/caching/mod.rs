//! PyTorch's CUDA caching allocator (SKELETON: being written).
