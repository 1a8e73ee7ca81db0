//! The links between GPUs of each preset: what a parallel layout's collectives travel over.
//!
//! Bandwidths are per GPU and per direction, in GB/s (10⁹ bytes per second), from the vendors'
//! datasheets (their NVLink and PCIe figures are bidirectional totals, halved here). The network
//! between nodes is the reference system's (DGX H100/H200/B200: one 400 Gb/s ConnectX-7 per GPU;
//! DGX A100: one 200 Gb/s HDR per GPU; DGX-1 V100: four 100 Gb/s EDR for eight GPUs); PCIe cards,
//! which ship in no reference system, get 100 Gb/s Ethernet per GPU. The host link is the GPU's own
//! PCIe generation at x16 (Gen5 64, Gen4 32, Gen3 16 GB/s per direction): what CPU offload copies over.
//!
//! NCCL's channel count (what its device buffers scale with, [`crate::nccl`]) is chosen by its
//! topology search at runtime; the figure here is what NCCL logs on such systems: 32 channels on
//! NVSwitch systems (8×H100: NVIDIA/nccl#1685, "Channel 00/32 … 31/32"; 8×A100: pytorch#76103,
//! "Channel 04/32"), 4 over PCIe (NVIDIA/nccl#1706: "4 coll channels, … 4 p2p channels").

use vramsim_sim::device::DEFAULT_GPU;

/// How the GPUs of one node are connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// NVLink through NVSwitches (every GPU of the node at full NVLink bandwidth).
    NvSwitch,
    /// NVLink in a hybrid cube mesh (DGX-1).
    NvLinkMesh,
    /// AMD Infinity Fabric, fully connected.
    InfinityFabric,
    /// PCIe through the host.
    Pcie,
}

impl LinkKind {
    /// The link's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            LinkKind::NvSwitch => "NVLink (NVSwitch)",
            LinkKind::NvLinkMesh => "NVLink (hybrid cube mesh)",
            LinkKind::InfinityFabric => "Infinity Fabric",
            LinkKind::Pcie => "PCIe",
        }
    }
}

/// The links of a GPU preset.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Links {
    /// The GPU preset (`vramsim gpus`).
    pub preset: &'static str,
    /// How the GPUs of a node are connected.
    pub intra: LinkKind,
    /// Bandwidth between GPUs of one node, per GPU and direction (GB/s).
    pub intra_gbs: f64,
    /// Network bandwidth between nodes, per GPU and direction (GB/s).
    pub inter_gbs: f64,
    /// The GPU's PCIe link to the host, per direction (GB/s): what CPU offload copies over.
    pub host_gbs: f64,
    /// NCCL channels of one communicator on such a node.
    pub nccl_channels: u32,
    /// Where the figures come from.
    pub source: &'static str,
}

/// 400 Gb/s per GPU (DGX H100/H200/B200's ConnectX-7), in GB/s.
const NDR_400: f64 = 50.0;
/// 200 Gb/s per GPU (DGX A100's HDR ConnectX-6), in GB/s.
const HDR_200: f64 = 25.0;
/// 100 Gb/s Ethernet per GPU, in GB/s.
const ETH_100: f64 = 12.5;

const fn link(
    preset: &'static str,
    intra: LinkKind,
    intra_gbs: f64,
    inter_gbs: f64,
    host_gbs: f64,
    source: &'static str,
) -> Links {
    let nccl_channels = match intra {
        LinkKind::Pcie => 4,
        _ => 32,
    };
    Links {
        preset,
        intra,
        intra_gbs,
        inter_gbs,
        host_gbs,
        nccl_channels,
        source,
    }
}

/// The links of every GPU preset.
pub const LINKS: &[Links] = &[
    link(
        "h100-80gb",
        LinkKind::NvSwitch,
        450.0,
        NDR_400,
        64.0,
        "H100 SXM5 datasheet: NVLink 900 GB/s; DGX H100: 8× ConnectX-7 400 Gb/s",
    ),
    link(
        "h100-pcie",
        LinkKind::Pcie,
        64.0,
        ETH_100,
        64.0,
        "H100 PCIe datasheet: PCIe Gen5 128 GB/s (its NVLink bridge joins pairs only)",
    ),
    link(
        "h100-nvl",
        LinkKind::Pcie,
        64.0,
        ETH_100,
        64.0,
        "H100 NVL datasheet: PCIe Gen5 128 GB/s (its NVLink bridge joins pairs only)",
    ),
    link(
        "h200",
        LinkKind::NvSwitch,
        450.0,
        NDR_400,
        64.0,
        "H200 SXM datasheet: NVLink 900 GB/s; DGX H200: 8× ConnectX-7 400 Gb/s",
    ),
    link(
        "b200",
        LinkKind::NvSwitch,
        900.0,
        NDR_400,
        64.0,
        "DGX B200 datasheet: NVLink 5 1.8 TB/s per GPU, 8× ConnectX-7 400 Gb/s",
    ),
    link(
        "a100-40gb",
        LinkKind::NvSwitch,
        300.0,
        HDR_200,
        32.0,
        "A100 SXM4 datasheet: NVLink 600 GB/s; DGX A100: 8× ConnectX-6 200 Gb/s",
    ),
    link(
        "a100-80gb",
        LinkKind::NvSwitch,
        300.0,
        HDR_200,
        32.0,
        "A100 SXM4 datasheet: NVLink 600 GB/s; DGX A100: 8× ConnectX-6 200 Gb/s",
    ),
    link(
        "v100-16gb",
        LinkKind::NvLinkMesh,
        150.0,
        6.25,
        16.0,
        "V100 SXM2 datasheet: NVLink 300 GB/s; DGX-1: 4× EDR 100 Gb/s for 8 GPUs",
    ),
    link(
        "v100-32gb",
        LinkKind::NvLinkMesh,
        150.0,
        6.25,
        16.0,
        "V100 SXM2 datasheet: NVLink 300 GB/s; DGX-1: 4× EDR 100 Gb/s for 8 GPUs",
    ),
    link(
        "a10g",
        LinkKind::Pcie,
        32.0,
        ETH_100,
        32.0,
        "PCIe Gen4 x16: 64 GB/s",
    ),
    link(
        "a10",
        LinkKind::Pcie,
        32.0,
        ETH_100,
        32.0,
        "A10 datasheet: PCIe Gen4 64 GB/s",
    ),
    link(
        "l4",
        LinkKind::Pcie,
        32.0,
        ETH_100,
        32.0,
        "L4 datasheet: PCIe Gen4 x16 64 GB/s",
    ),
    link(
        "l40s",
        LinkKind::Pcie,
        32.0,
        ETH_100,
        32.0,
        "L40S datasheet: PCIe Gen4 x16 64 GB/s",
    ),
    link(
        "a40",
        LinkKind::Pcie,
        32.0,
        ETH_100,
        32.0,
        "A40 datasheet: PCIe Gen4 64 GB/s (its NVLink bridge joins pairs only)",
    ),
    link(
        "a6000",
        LinkKind::Pcie,
        32.0,
        ETH_100,
        32.0,
        "RTX A6000 datasheet: PCIe Gen4 x16 (its NVLink bridge joins pairs only)",
    ),
    link(
        "rtx6000-ada",
        LinkKind::Pcie,
        32.0,
        ETH_100,
        32.0,
        "RTX 6000 Ada datasheet: PCIe Gen4 x16 64 GB/s",
    ),
    link(
        "t4",
        LinkKind::Pcie,
        16.0,
        ETH_100,
        16.0,
        "T4 datasheet: PCIe Gen3 x16 32 GB/s",
    ),
    link(
        "rtx3090",
        LinkKind::Pcie,
        32.0,
        ETH_100,
        32.0,
        "PCIe Gen4 x16: 64 GB/s",
    ),
    link(
        "rtx4090",
        LinkKind::Pcie,
        32.0,
        ETH_100,
        32.0,
        "PCIe Gen4 x16: 64 GB/s",
    ),
    link(
        "rtx5090",
        LinkKind::Pcie,
        64.0,
        ETH_100,
        64.0,
        "PCIe Gen5 x16: 128 GB/s",
    ),
    link(
        "mi300x",
        LinkKind::InfinityFabric,
        448.0,
        NDR_400,
        64.0,
        "MI300X datasheet: 7 Infinity Fabric links, 896 GB/s peer-to-peer; 400 Gb/s per GPU",
    ),
];

/// The links of the GPU preset `gpu` (the default GPU's when `None`, or for a device described by
/// `--capacity` or a calibration, whose links vramsim does not know).
pub fn links(gpu: Option<&str>) -> &'static Links {
    let name = gpu.unwrap_or(DEFAULT_GPU);
    LINKS
        .iter()
        .find(|l| l.preset == name)
        .or_else(|| LINKS.iter().find(|l| l.preset == DEFAULT_GPU))
        .expect("the default GPU preset has links")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_gpu_preset_has_links() {
        for p in vramsim_sim::device::PRESETS {
            assert!(
                LINKS.iter().any(|l| l.preset == p.name),
                "{} has no links",
                p.name
            );
        }
        assert_eq!(links(None).preset, DEFAULT_GPU);
    }
}
