//! The device model: capacity, the CUDA context, other processes, and GPU presets.
//!
//! A [`Device`] is what the allocator sees of a GPU: `total_memory` (what
//! `torch.cuda.get_device_properties(i).total_memory` reports, i.e. CUDA's `totalGlobalMem`, which is also
//! the total of `cudaMemGetInfo`), the bytes of this process's CUDA context, and the bytes other processes
//! hold. Only what is left after the context and the other processes can become allocator segments.
//!
//! # Where the preset figures come from
//!
//! [`PRESETS`] holds real figures read from public logs, never marketing sizes ("80 GB" is neither
//! 80·10⁹ nor 80·2³⁰ bytes usable). Three kinds of evidence were used, best first:
//!
//! 1. `deviceQuery` output, `Total amount of global memory: N MBytes (B bytes)`, or a
//!    `GpuDeviceInfoProto.device_memory_size`: exact bytes.
//! 2. The repr of `torch.cuda.get_device_properties`, `total_memory=NMB`: that is `total_memory // 2**20`,
//!    so the figure is known to the MiB and stored as `N × 2^20`.
//! 3. An OOM message, `GPU 0 has a total capacity of X GiB` (older PyTorch: `X GiB total capacity`), which
//!    `format_size` rounds to 1/100 GiB: known to about ±5 MiB. Used alone only where nothing better was
//!    found, and said so in the preset's `source`.
//!
//! The same board reports slightly different totals under different drivers (the driver reserves a
//! little more or less memory): an 80 GB H100 SXM has been seen at 79.10–79.21 GiB. Each preset gives one
//! observed figure, names the driver where the source does, and lists other observations. For an exact
//! match with a particular machine, pass its own `total_memory` as a capacity instead of a preset.

use std::fmt;

use thiserror::Error;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// The preset used when none is named: an 80 GB H100 SXM, the most common training GPU in public reports.
pub const DEFAULT_GPU: &str = "h100-80gb";

/// Bytes a process's CUDA context takes when no measurement applies ([`GpuPreset::context`]): 512 MiB.
///
/// The context is memory PyTorch never sees: it is in `nvidia-smi` and lowers `cudaMemGetInfo` free, so
/// it counts in device-used, but it is in none of the allocator's statistics (fact sheet §14.1). Its size
/// depends on the GPU, the driver, the CUDA version and on module loading: lazy loading
/// (`CUDA_MODULE_LOADING=LAZY`, the default on Linux since CUDA 12.2, and set by PyTorch since 1.13) keeps
/// it to roughly 300–600 MiB (287,047,680 B measured in PyTorch PR #86509; "around 400MB" in #109888;
/// 256 MiB bare on an RTX 3090 with torch 2.7.1+cu128), eager loading to 0.7–1.7 GiB.
///
/// Presets take a measured figure per CUDA major version where one was published
/// ([`CONTEXT_MEASUREMENTS`]); this figure stands for the rest with CUDA 12 and 13 (the H100/H200
/// figures are unconfirmed). 512 MiB sits in the upper half of the lazy-loading range on purpose: it
/// also absorbs the first kernels' module loads, and erring high makes a predicted fit a safer promise.
/// Override it per run (`Device::context_bytes`, `--context`) when the real figure is known.
pub const DEFAULT_CONTEXT_BYTES: u64 = 512 * MIB;

/// The CUDA major versions `--cuda` accepts.
pub const CUDA_VERSIONS: [u32; 3] = [11, 12, 13];

/// The CUDA major version of what `pip install torch` installs today: torch 2.15.0 on PyPI is built
/// with CUDA 13.2 (`torch.version.cuda == '13.2'`, wheel `2.15.0+cu132` requiring
/// `nvidia-cuda-runtime` 13.2).
pub const DEFAULT_CUDA: u32 = 13;

/// A published CUDA context size: what a process holds on the GPU before its allocator holds anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextMeasurement {
    /// The preset it was measured on.
    pub gpu: &'static str,
    /// The CUDA major version.
    pub cuda: u32,
    /// Bytes.
    pub bytes: u64,
    /// Where it comes from and how the figure is derived from what was printed.
    pub source: &'static str,
}

/// Every CUDA context figure vramsim uses, with its source (fact sheet §14.1). Lazy module loading
/// (CUDA ≥ 11.7 with `CUDA_MODULE_LOADING=LAZY`, set by PyTorch since 1.13; the default from CUDA
/// 12.2) is why CUDA 12 and 13 contexts are a third of CUDA 11's.
pub const CONTEXT_MEASUREMENTS: &[ContextMeasurement] = &[
    ContextMeasurement {
        gpu: "v100-16gb",
        cuda: 11,
        bytes: 1339 * MIB,
        source: "HF transformers docs 'Model training anatomy' (model_memory_anatomy.md): NVML used \
                 1343 MB after torch.ones((1, 1)).to('cuda') on a Tesla V100-SXM2 16GB, driver \
                 460.91.03 (CUDA 11.2); less the 2 MiB small-pool segment of that tensor and the 2 MiB \
                 the same page's nvidia-smi shows used but not by the process (2631 vs 2629 MiB)",
    },
    ContextMeasurement {
        gpu: "rtx3090",
        cuda: 11,
        bytes: 1685 * MIB,
        source: "pytorch/pytorch issue #55277 (2022-04-12 comment): 1687 MB of GPU memory after \
                 torch.Tensor(1).cuda() on an RTX 3090, torch 1.8.2+cu111 (721 MB on a GTX 1080 with \
                 cu101); less the tensor's 2 MiB small-pool segment",
    },
    ContextMeasurement {
        gpu: "rtx3090",
        cuda: 12,
        bytes: 256 * MIB,
        source: "invoke-ai/InvokeAI issue #9413: nvidia-smi shows the process at 256 MiB, a bare \
                 context, on an RTX 3090, torch 2.7.1+cu128, driver 610.43.03",
    },
    ContextMeasurement {
        gpu: "h100-80gb",
        cuda: 13,
        bytes: 552_402_944, // 526.81 MiB
        source: "vramsim's own validation run (testdata/h100-train-steps/README.md, 2026-11-24): \
                 total - free of torch.cuda.mem_get_info() as a process's first CUDA call on an H100 \
                 80GB HBM3, driver 580.159.04, torch 2.11.0+cu130; the same bytes from cuInit + \
                 cuCtxCreate in vramsim-validate's probe",
    },
    ContextMeasurement {
        gpu: "h200",
        cuda: 13,
        bytes: 552_402_944, // 526.81 MiB
        source: "vramsim's own validation run (validate/README.md, 2026-11-24): total - free of \
                 torch.cuda.mem_get_info() as a process's first CUDA call on an H200 (total_memory \
                 150,109,880,320 B), driver 580.159.04, torch 2.11.0+cu130: the H100's bytes",
    },
    ContextMeasurement {
        gpu: "rtx6000-ada",
        cuda: 13,
        bytes: 426 * MIB,
        source: "unslothai/unsloth-zoo PR #1053: 426 MiB on an RTX 6000 Ada, torch 2.10.0+cu130, after \
                 torch.cuda.mem_get_info",
    },
];

/// The device memory a training step adds outside the caching allocator as it runs: under lazy module
/// loading (CUDA ≥ 12, `CUDA_MODULE_LOADING=LAZY`) the kernels and the cuBLAS handles a step uses are
/// loaded into the context at their first call, so the process holds this much more than its bare
/// context from the first step on (what `nvidia-smi` shows, and what an out-of-memory message's
/// "this process has ... in use" counts).
///
/// Every such figure vramsim uses, as [`ContextMeasurement`]s whose bytes are beyond the bare context.
pub const MODULE_MEASUREMENTS: &[ContextMeasurement] = &[
    ContextMeasurement {
        gpu: "h100-80gb",
        cuda: 13,
        bytes: 234_881_024, // 224 MiB
        source: "vramsim's own validation run (testdata/h100-train-steps/README.md, 2026-11-24): \
                 total - free of torch.cuda.mem_get_info() less memory_reserved() after two training steps \
                 (787,283,968 B) less the bare context (552,402,944 B), the same in every step of GPT-2, BERT \
                 and an MLP that ran cuBLAS and elementwise kernels on an H100 80GB, torch 2.11.0+cu130; \
                 16 MiB more where cuDNN ran (convolutions, cuDNN attention), not counted",
    },
    ContextMeasurement {
        gpu: "h200",
        cuda: 13,
        bytes: 234_881_024, // 224 MiB
        source: "vramsim's own validation run (validate/README.md, 2026-11-24): the same steps (GPT-2, \
                 an MLP) on an H200, torch 2.11.0+cu130: 787,283,968 B outside the allocator after two \
                 steps less the 552,402,944 B bare context, as on the H100",
    },
];

/// The CUDA context a preset gets under a CUDA major version, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContextChoice {
    /// Bytes.
    pub bytes: u64,
    /// The CUDA major version.
    pub cuda: u32,
    /// `measured`, `rule` or `assumption`, with the source.
    pub source: String,
}

/// A CUDA major version `--cuda` does not know.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("unknown CUDA version {0:?}; valid versions are 11, 12, 13 (major versions)")]
pub struct UnknownCuda(pub String);

/// Reads a `--cuda` value: a major version (`12`), or `major.minor` (`12.8`, whose major counts).
pub fn parse_cuda(input: &str) -> Result<u32, UnknownCuda> {
    let s = input.trim();
    let major = s.split('.').next().unwrap_or("");
    match major.parse::<u32>() {
        Ok(m)
            if CUDA_VERSIONS.contains(&m)
                && s.split('.').skip(1).all(|p| p.parse::<u32>().is_ok()) =>
        {
            Ok(m)
        }
        _ => Err(UnknownCuda(input.to_string())),
    }
}

/// Memory held on the device by another process (shown by NVML in OOM messages).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtherProcess {
    /// Its process id.
    pub pid: u32,
    /// Bytes it holds.
    pub bytes: u64,
}

/// A GPU as the allocator sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Device {
    /// Device index (`GPU 0` in messages).
    pub index: u32,
    /// Marketing name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// `torch.cuda.get_device_properties().total_memory` in bytes.
    pub total_memory: u64,
    /// Bytes the CUDA context of this process takes (invisible to allocator stats).
    pub context_bytes: u64,
    /// Memory held by other processes.
    pub other_processes: Vec<OtherProcess>,
}

impl Device {
    /// A device with the given total memory, no context and no other processes.
    pub fn with_capacity(total_memory: u64) -> Device {
        Device {
            index: 0,
            name: "custom".to_string(),
            total_memory,
            context_bytes: 0,
            other_processes: Vec::new(),
        }
    }

    /// The device of a named preset (see [`PRESETS`]), with its CUDA context under [`DEFAULT_CUDA`]
    /// ([`GpuPreset::context`]) and no other processes.
    ///
    /// Names are matched without regard to case, `-`, `_` or spaces (`H100_80GB`, `rtx-4090`), and `h100`
    /// and `h100-sxm` mean `h100-80gb`.
    pub fn preset(name: &str) -> Result<Device, UnknownGpu> {
        let preset = find_preset(name).ok_or_else(|| UnknownGpu {
            name: name.to_string(),
        })?;
        Ok(preset.device())
    }

    /// Bytes used on the device by everything except this process's allocator.
    pub fn non_allocator_bytes(&self) -> u64 {
        self.context_bytes + self.other_processes.iter().map(|p| p.bytes).sum::<u64>()
    }

    /// `cudaMemGetInfo` free bytes when the allocator holds `reserved` bytes.
    pub fn free_memory(&self, reserved: u64) -> u64 {
        self.total_memory
            .saturating_sub(self.non_allocator_bytes())
            .saturating_sub(reserved)
    }
}

/// One GPU model with the total memory CUDA reports for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuPreset {
    /// The key used on the command line (`h100-80gb`).
    pub name: &'static str,
    /// What `torch.cuda.get_device_name()` reports (`NVIDIA H100 80GB HBM3`).
    pub device_name: &'static str,
    /// What `torch.cuda.get_device_properties(0).total_memory` reports, in bytes.
    pub total_memory: u64,
    /// `torch.cuda.get_device_capability()`: (major, minor). Kernel choices depend on it (SDPA
    /// backends, cuBLAS workspace sizes). NVIDIA's CUDA GPUs table; ROCm reports gfx942 as (9, 4).
    pub compute_capability: (u32, u32),
    /// Where the figure comes from, how precisely it is known, and other figures seen for the same board.
    pub source: &'static str,
}

impl GpuPreset {
    /// A [`Device`] with this preset's name and capacity, the CUDA context of [`GpuPreset::context`] under
    /// [`DEFAULT_CUDA`], and no other processes.
    pub fn device(&self) -> Device {
        self.device_with_cuda(DEFAULT_CUDA)
    }

    /// A [`Device`] with this preset's name and capacity and its CUDA context under CUDA `cuda`.
    pub fn device_with_cuda(&self, cuda: u32) -> Device {
        Device {
            index: 0,
            name: self.device_name.to_string(),
            total_memory: self.total_memory,
            context_bytes: self.context(cuda).bytes,
            other_processes: Vec::new(),
        }
    }

    /// The CUDA context this preset gets under CUDA major version `cuda`, first of:
    ///
    /// 1. a measurement on this GPU with that CUDA ([`CONTEXT_MEASUREMENTS`]);
    /// 2. rule: a measurement with that CUDA on a preset of the same compute capability (the same
    ///    chip generation loads the same kernel images);
    /// 3. rule, CUDA 11 only: the CUDA 11 measurement on the nearest compute capability, as eager
    ///    module loading of every kernel image dominates a CUDA 11 context;
    /// 4. assumption: [`DEFAULT_CONTEXT_BYTES`], inside the lazy-loading range of CUDA ≥ 12.
    pub fn context(&self, cuda: u32) -> ContextChoice {
        let choice = |bytes, source: String| ContextChoice {
            bytes,
            cuda,
            source,
        };
        if let Some(found) = self.measured_or_same_arch(CONTEXT_MEASUREMENTS, cuda) {
            return found;
        }
        let cc = |(major, minor): (u32, u32)| i64::from(major * 10 + minor);
        let nearest = CONTEXT_MEASUREMENTS
            .iter()
            .filter(|m| m.cuda == cuda && cuda == 11)
            .filter_map(|m| find_preset(m.gpu).map(|p| (m, cc(p.compute_capability))))
            .min_by_key(|(_, c)| (c - cc(self.compute_capability)).abs());
        if let Some((m, _)) = nearest {
            return choice(
                m.bytes,
                format!(
                    "rule: no CUDA 11 measurement on this architecture; CUDA 11 loads every kernel module eagerly, so the {}'s (the nearest compute capability measured) is used, measured: {}",
                    m.gpu, m.source
                ),
            );
        }
        choice(
            DEFAULT_CONTEXT_BYTES,
            format!(
                "assumption: no measurement with CUDA {cuda} on this architecture; 512 MiB, inside the 300-600 MiB range of lazily loaded contexts (PyTorch PR #86509: 287,047,680 B; issue #109888: about 400 MB)"
            ),
        )
    }

    /// The device memory a training step's kernels add to the context on this preset under CUDA
    /// `cuda` ([`MODULE_MEASUREMENTS`]): measured on it, or (rule) on a preset of the same compute
    /// capability with that CUDA; `None` where nothing was measured, and under CUDA 11, whose eager
    /// module loading puts every kernel in the bare context already.
    pub fn step_modules(&self, cuda: u32) -> Option<ContextChoice> {
        self.measured_or_same_arch(MODULE_MEASUREMENTS, cuda)
    }

    /// The first two rungs of [`GpuPreset::context`] over `table`: a measurement on this preset
    /// with CUDA `cuda`, else (rule) one on a preset of the same compute capability with it.
    fn measured_or_same_arch(
        &self,
        table: &[ContextMeasurement],
        cuda: u32,
    ) -> Option<ContextChoice> {
        let choice = |bytes, source: String| ContextChoice {
            bytes,
            cuda,
            source,
        };
        if let Some(m) = table.iter().find(|m| m.gpu == self.name && m.cuda == cuda) {
            return Some(choice(m.bytes, format!("measured: {}", m.source)));
        }
        table
            .iter()
            .find(|m| {
                m.cuda == cuda
                    && find_preset(m.gpu)
                        .is_some_and(|p| p.compute_capability == self.compute_capability)
            })
            .map(|m| {
                let (major, minor) = self.compute_capability;
                choice(
                    m.bytes,
                    format!(
                        "rule: no measurement on this GPU; the {} (same compute capability {major}.{minor}) with CUDA {cuda}, measured: {}",
                        m.gpu, m.source
                    ),
                )
            })
    }
}

/// Other names accepted for presets.
const ALIASES: &[(&str, &str)] = &[("h100", "h100-80gb"), ("h100-sxm", "h100-80gb")];

/// Known GPUs, data-centre first, each with a sourced `total_memory` (see the module documentation).
pub const PRESETS: &[GpuPreset] = &[
    GpuPreset {
        name: "h100-80gb",
        device_name: "NVIDIA H100 80GB HBM3",
        total_memory: 85_017_755_648, // 81,079 MiB, 79.18 GiB
        compute_capability: (9, 0),
        source: "exact: deviceQuery 'Total amount of global memory: 81079 MBytes (85017755648 bytes)', \
                 CUDA driver 13.0 / runtime 12.5, in LandonTClipp/LandonTClipp.github.io blog post \
                 'GPU-based Containers as a Service' (2025-10-21); matches the OOM 'GPU 0 has a total \
                 capacity of 79.18 GiB' on 1xH100 HBM3 in prime-rl benchmarks/results/BENCHMARKS.md \
                 (shyampathak22/prime-rl). Other drivers: 85045477376 B (79.20 GiB, driver 12.7, \
                 thamada/nvidia-smi nvsim/H100SXMx8_deviceQuery.py), 84978434048 B (79.14 GiB, openxla \
                 gpu_specs h100_sxm.txtpb), torch reprs 81082-81090MB, OOMs 79.10-79.21 GiB",
    },
    GpuPreset {
        name: "h100-pcie",
        device_name: "NVIDIA H100 PCIe",
        total_memory: 84_942_979_072, // 81,007 MiB, 79.11 GiB
        compute_capability: (9, 0),
        source: "exact: openxla/xla xla/tools/hlo_opt/gpu_specs/h100_pcie.txtpb device_memory_size \
                 84942979072 (device_description_str 'NVIDIA H100 PCIe'); no OOM message from an H100 \
                 PCIe found to cross-check",
    },
    GpuPreset {
        name: "h100-nvl",
        device_name: "NVIDIA H100 NVL",
        total_memory: 99_861_594_112, // 95,235 MiB, 93.00 GiB
        compute_capability: (9, 0),
        source: "exact: deviceQuery '95235 MBytes (99861594112 bytes)', CUDA driver 12.4, \
                 thamada/nvidia-smi gls/H100NVLx2_deviceQuery.py; no OOM message found to cross-check",
    },
    GpuPreset {
        name: "h200",
        device_name: "NVIDIA H200",
        total_memory: 143_156 * MIB, // 139.80 GiB
        compute_capability: (9, 0),
        source: "to the MiB: torch repr 'total_memory=143156MB' in ai-bot-pro/achatbot \
                 deploy/modal/src/llm/vllm/vlm/skywork_r1v.py (Modal H200); matches the OOM 'total \
                 capacity of 139.80 GiB' on 8xH200 in prime-rl benchmarks/results/BENCHMARKS.md; \
                 139.81 GiB also seen (sungwon-chae/arxiv_confi etu_logging.md)",
    },
    GpuPreset {
        name: "b200",
        device_name: "NVIDIA B200",
        total_memory: 182_642 * MIB, // 178.36 GiB
        compute_capability: (10, 0),
        source: "to the MiB: torch repr 'total_memory=182642MB' in ai-bot-pro/achatbot \
                 deploy/modal/src/llm/vllm/vlm/skywork_r1v.py (Modal B200); matches the OOM 'total \
                 capacity of 178.36 GiB' on 8xB200 in shyampathak22/prime-rl \
                 benchmarks/results/BENCHMARKS.md; another driver gave 182631MB (178.35 GiB)",
    },
    GpuPreset {
        name: "a100-40gb",
        device_name: "NVIDIA A100-SXM4-40GB",
        total_memory: 42_331_013_120, // 40,370 MiB, 39.42 GiB
        compute_capability: (8, 0),
        source: "exact: openxla/xla xla/tools/hlo_opt/gpu_specs/a100_sxm_40.txtpb device_memory_size \
                 42331013120. Other drivers: 42298834944 B (40339 MiB, 39.39 GiB, driver 12.2, \
                 deviceQuery in bottlerocket-os/bottlerocket#3873); older drivers 40536 MiB (39.59 GiB, \
                 the familiar Colab/2021-era OOM figure; repr in PaddlePaddle's \
                 get_device_properties docstring)",
    },
    GpuPreset {
        name: "a100-80gb",
        device_name: "NVIDIA A100-SXM4-80GB",
        total_memory: 85_100_068_864, // 81,157 MiB, 79.26 GiB
        compute_capability: (8, 0),
        source: "exact, two sources agree: deviceQuery '81158 MBytes (85100068864 bytes)', CUDA driver \
                 12.5, thamada/nvidia-smi nvsim/A100SXMx4_deviceQuery.py, and openxla/xla \
                 gpu_specs/a100_sxm_80.txtpb device_memory_size 85100068864. Other drivers: OOMs of \
                 79.14 GiB (Control-GIC#6), 79.15 GiB and 79.25 GiB; A100 80GB PCIe 81049 MiB \
                 (ekondis/mixbench#47)",
    },
    GpuPreset {
        name: "v100-16gb",
        device_name: "Tesla V100-SXM2-16GB",
        total_memory: 16_935_419_904, // 16,150 MiB, 15.77 GiB
        compute_capability: (7, 0),
        source: "exact: openxla/xla xla/tools/hlo_opt/gpu_specs/v100.txtpb device_memory_size \
                 16935419904 ('Tesla V100-SXM2-16GB'); OOMs of 15.75-15.78 GiB appear in public logs \
                 under various drivers",
    },
    GpuPreset {
        name: "v100-32gb",
        device_name: "Tesla V100-SXM2-32GB",
        total_memory: 32_502 * MIB, // 31.74 GiB
        compute_capability: (7, 0),
        source: "approximate, about ±5 MiB: only from the OOM '31.74 GiB total capacity' on a V100 32GB \
                 (liucongg/ChatGLM-Finetuning#73, 2023); no repr or deviceQuery found",
    },
    GpuPreset {
        name: "a10g",
        device_name: "NVIDIA A10G",
        total_memory: 22_733 * MIB, // 22.20 GiB
        compute_capability: (8, 6),
        source: "approximate, about ±5 MiB: only from the OOM '22.20 GiB total capacity' on an AWS \
                 g5.12xlarge (A10G) (XavierXiao/Dreambooth-Stable-Diffusion#18, 2023); a 2026 torch \
                 nightly (cu130) printed total_memory=22587MB (22.06 GiB), so newer drivers report less",
    },
    GpuPreset {
        name: "a10",
        device_name: "NVIDIA A10",
        total_memory: 23_609_475_072, // 22,515 MiB, 21.99 GiB
        compute_capability: (8, 6),
        source: "exact: deviceQuery-style '21.99 GBytes (23609475072 bytes)', CUDA driver 12.2, \
                 aalanwyr/face2cuda step2cuda/README.md; no OOM message found to cross-check",
    },
    GpuPreset {
        name: "l4",
        device_name: "NVIDIA L4",
        total_memory: 23_570_219_008, // 22,478 MiB, 21.95 GiB
        compute_capability: (8, 9),
        source: "exact: deviceQuery '22478 MBytes (23570219008 bytes)', CUDA driver 12.4, \
                 thamada/nvidia-smi gls/L4_deviceQuery.py; no OOM message found to cross-check",
    },
    GpuPreset {
        name: "l40s",
        device_name: "NVIDIA L40S",
        total_memory: 47_803_596_800, // 45,589 MiB, 44.52 GiB
        compute_capability: (8, 9),
        source: "exact: deviceQuery '45589 MBytes (47803596800 bytes)', CUDA driver 12.4, \
                 thamada/nvidia-smi nvsim/L40S_deviceQuery.py; OOMs of 44.52 GiB appear in public logs, \
                 and one of 44.53 GiB on an L40S under another driver (Wan-Video/Wan2.1#205)",
    },
    GpuPreset {
        name: "a40",
        device_name: "NVIDIA A40",
        total_memory: 47_608_692_736, // 45,403 MiB, 44.34 GiB
        compute_capability: (8, 6),
        source: "exact: deviceQuery '45403 MBytes (47608692736 bytes)', CUDA driver 12.4, \
                 thamada/nvidia-smi nvsim/A40x10_deviceQuery.py",
    },
    GpuPreset {
        name: "a6000",
        device_name: "NVIDIA RTX A6000",
        total_memory: 51_041_271_808, // 48,676 MiB, 47.54 GiB
        compute_capability: (8, 6),
        source: "exact: openxla/xla xla/tools/hlo_opt/gpu_specs/a6000.txtpb device_memory_size \
                 51041271808 ('NVIDIA RTX A6000')",
    },
    GpuPreset {
        name: "rtx6000-ada",
        device_name: "NVIDIA RTX 6000 Ada Generation",
        total_memory: 51_002_867_712, // 48,640 MiB, 47.50 GiB
        compute_capability: (8, 9),
        source: "exact: deviceQuery '48640 MBytes (51002867712 bytes)', CUDA driver 12.4, \
                 thamada/nvidia-smi gls/RTX6000Ada_x8_deviceQuery.py",
    },
    GpuPreset {
        name: "t4",
        device_name: "Tesla T4",
        total_memory: 15_095 * MIB, // 14.74 GiB
        compute_capability: (7, 5),
        source: "to the MiB: deviceQuery 'Global Memory 15095 MBytes' on Colab, CUDA driver 12.4, \
                 sylvia-ymlin/cuda-kernels-from-scratch README.md, and a torch repr \
                 'total_memory=15095MB'. Other drivers: 15102-15109 MiB (14.75 GiB, e.g. the OOM in \
                 hpcaitech/Open-Sora#697), 14930-15079 MiB on older Colab images",
    },
    GpuPreset {
        name: "rtx3090",
        device_name: "NVIDIA GeForce RTX 3090",
        total_memory: 25_327_697_920, // 24,154 MiB, 23.59 GiB
        compute_capability: (8, 6),
        source: "exact: deviceQuery '24154 MBytes (25327697920 bytes)', CUDA driver 12.6, \
                 thamada/nvidia-smi gls/RTX3090_deviceQuery.py; matches the OOM 'total capacity of \
                 23.59 GiB' on an RTX 3090 (Stable-X/StableNormal#33). Older drivers: 24268 MiB \
                 (23.70 GiB, e.g. Lightning-AI/lit-llama#137, huggingface/transformers docs repr)",
    },
    GpuPreset {
        name: "rtx4090",
        device_name: "NVIDIA GeForce RTX 4090",
        total_memory: 25_386_352_640, // 24,210 MiB, 23.64 GiB
        compute_capability: (8, 9),
        source: "exact: deviceQuery '24210 MBytes (25386352640 bytes)', CUDA driver 12.4 (Linux), \
                 thamada/nvidia-smi gls/RTX4090_deviceQuery.py; matches the OOMs '23.64 GiB' on RTX \
                 4090s (3DTopia/Phidias-Diffusion#8, TMElyralab/MuseTalk#76). Windows reports more \
                 (a repr of 24563MB, 23.99 GiB)",
    },
    GpuPreset {
        name: "rtx5090",
        device_name: "NVIDIA GeForce RTX 5090",
        total_memory: 33_677_180_928, // 32,117 MiB, 31.36 GiB
        compute_capability: (12, 0),
        source: "exact: deviceQuery '32117 MBytes (33677180928 bytes)', CUDA driver 12.8 (Linux, \
                 570.133.04), aikitoria/open-gpu-kernel-modules#1; an OOM of 31.37 GiB on a 5090 under \
                 another driver/OS (Wan-Video/Wan2.1#465)",
    },
    GpuPreset {
        name: "mi300x",
        device_name: "AMD Instinct MI300X",
        total_memory: 196_592 * MIB, // 191.98 GiB
        compute_capability: (9, 4),
        source: "to the MiB: hipDeviceProp 'Total Global Memory (MB) 196592', thamada/nvidia-smi \
                 nvsim/MI300X_x4_deviceQuery.py (ROCm; PyTorch's HIP allocator is the same caching \
                 allocator); no OOM message found to cross-check",
    },
];

/// The preset called `name` (matched as [`Device::preset`] does), if there is one.
pub fn find_preset(name: &str) -> Option<&'static GpuPreset> {
    let key = normalize(name);
    let key = ALIASES
        .iter()
        .find(|(alias, _)| normalize(alias) == key)
        .map_or(key, |(_, target)| normalize(target));
    PRESETS.iter().find(|p| normalize(p.name) == key)
}

/// Lowercase, without `-`, `_` or whitespace.
fn normalize(name: &str) -> String {
    name.chars()
        .filter(|c| !matches!(c, '-' | '_') && !c.is_whitespace())
        .flat_map(char::to_lowercase)
        .collect()
}

/// A GPU preset name that is not in [`PRESETS`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownGpu {
    /// The name that was asked for.
    pub name: String,
}

impl fmt::Display for UnknownGpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown GPU preset {:?}; valid presets are: ", self.name)?;
        for (i, preset) in PRESETS.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(preset.name)?;
        }
        f.write_str(" (or give the device's total memory as a size, e.g. 24GiB)")
    }
}

impl std::error::Error for UnknownGpu {}

/// Why a size string could not be read by [`parse_size`].
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum SizeError {
    /// Nothing was given.
    #[error("empty size; expected a number of bytes with an optional unit, e.g. 24GiB, 80GB, 80e9 or 512")]
    Empty,
    /// The number was negative.
    #[error("size {0:?} is negative; sizes are byte counts, 0 or more")]
    Negative(String),
    /// The number was NaN or infinite.
    #[error("size {0:?} is not a finite number")]
    NotFinite(String),
    /// The number could not be read.
    #[error("size {0:?} does not start with a number (digits, an optional fraction and exponent, e.g. 1.5 or 80e9)")]
    BadNumber(String),
    /// The unit is not one of the known ones.
    #[error("size {input:?} has unknown unit {unit:?}; use B, KB, KiB, MB, MiB, GB, GiB, TB or TiB (any case; KB = 1000 bytes, KiB = 1024 bytes) or no unit for bytes")]
    UnknownUnit {
        /// The whole input.
        input: String,
        /// The unit part.
        unit: String,
    },
    /// The size does not fit in 64 bits.
    #[error("size {0:?} is 2^64 bytes or more, too large to represent")]
    Overflow(String),
}

/// Reads a byte count: a number with an optional unit, e.g. `24GiB`, `24GB`, `80e9`, `1024MiB`, `512`,
/// `1.5GiB`, `24 gib`.
///
/// Units are case-insensitive: `B`; decimal `KB`, `MB`, `GB`, `TB` (powers of 1000); binary `KiB`, `MiB`,
/// `GiB`, `TiB` (powers of 1024); no unit means bytes. The number may have a fraction and a decimal
/// exponent; it is evaluated exactly and rounded to the nearest byte (`0.5` rounds up).
pub fn parse_size(input: &str) -> Result<u64, SizeError> {
    let text = input.trim();
    if text.is_empty() {
        return Err(SizeError::Empty);
    }
    if text.starts_with('-') {
        return Err(SizeError::Negative(input.to_string()));
    }
    let unsigned = text.strip_prefix('+').unwrap_or(text);
    let lower = unsigned.to_ascii_lowercase();
    if lower.starts_with("nan") || lower.starts_with("inf") {
        return Err(SizeError::NotFinite(input.to_string()));
    }

    // The number is the longest prefix of digits, '.', and an exponent 'e[+-]digits'.
    let bytes = unsigned.as_bytes();
    let mut end = 0;
    while end < bytes.len() && (bytes[end].is_ascii_digit() || bytes[end] == b'.') {
        end += 1;
    }
    if end < bytes.len() && (bytes[end] == b'e' || bytes[end] == b'E') {
        let mut exp_end = end + 1;
        if exp_end < bytes.len() && (bytes[exp_end] == b'+' || bytes[exp_end] == b'-') {
            exp_end += 1;
        }
        let digits_start = exp_end;
        while exp_end < bytes.len() && bytes[exp_end].is_ascii_digit() {
            exp_end += 1;
        }
        if exp_end > digits_start {
            end = exp_end;
        }
    }
    let (number, unit) = unsigned.split_at(end);
    let unit = unit.trim();
    let multiplier: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => KIB as u128,
        "mib" => MIB as u128,
        "gib" => GIB as u128,
        "tib" => TIB as u128,
        _ => {
            if number.is_empty() {
                return Err(SizeError::BadNumber(input.to_string()));
            }
            return Err(SizeError::UnknownUnit {
                input: input.to_string(),
                unit: unit.to_string(),
            });
        }
    };
    let decimal = Decimal::parse(number).ok_or_else(|| SizeError::BadNumber(input.to_string()))?;
    decimal
        .times(multiplier)
        .ok_or_else(|| SizeError::Overflow(input.to_string()))
}

/// A non-negative decimal `digits × 10^exponent`, read exactly.
struct Decimal {
    digits: u128,
    exponent: i64,
}

impl Decimal {
    /// Reads `123`, `1.5`, `.5`, `80e9`, `2.5E-3`; `None` if malformed. Digits beyond the 21st significant
    /// one are dropped: a u64 has 20 digits, so they are far below a byte for any size that fits, and
    /// keeping 21 leaves `digits × unit × 10^k` well inside u128 whenever the result fits in a u64.
    fn parse(text: &str) -> Option<Decimal> {
        let (mantissa, exponent) = match text.find(['e', 'E']) {
            Some(at) => (&text[..at], text[at + 1..].parse::<i64>().ok()?),
            None => (text, 0),
        };
        let (int_part, frac_part) = match mantissa.split_once('.') {
            Some((i, f)) => (i, f),
            None => (mantissa, ""),
        };
        if int_part.is_empty() && frac_part.is_empty() {
            return None;
        }
        if !int_part
            .bytes()
            .chain(frac_part.bytes())
            .all(|b| b.is_ascii_digit())
        {
            return None;
        }
        let all_digits = format!("{int_part}{frac_part}");
        let significant = all_digits.trim_start_matches('0');
        let kept = &significant[..significant.len().min(21)];
        let dropped = (significant.len() - kept.len()) as i64;
        let digits = if kept.is_empty() {
            0
        } else {
            kept.parse::<u128>().ok()?
        };
        Some(Decimal {
            digits,
            exponent: exponent
                .checked_sub(frac_part.len() as i64)?
                .checked_add(dropped)?,
        })
    }

    /// `self × multiplier` rounded to the nearest integer, or `None` if it is 2^64 or more.
    fn times(&self, multiplier: u128) -> Option<u64> {
        if self.digits == 0 {
            return Some(0);
        }
        let scaled = self.digits.checked_mul(multiplier)?;
        let value = if self.exponent >= 0 {
            let power = 10u128.checked_pow(u32::try_from(self.exponent).ok()?)?;
            scaled.checked_mul(power)?
        } else {
            match 10u128.checked_pow(u32::try_from(-self.exponent).ok()?) {
                // Round half up.
                Some(power) => scaled / power + u128::from(scaled % power >= power.div_ceil(2)),
                // 10^-exponent exceeds any u128 numerator: the value rounds to 0.
                None => 0,
            }
        };
        u64::try_from(value).ok()
    }
}
