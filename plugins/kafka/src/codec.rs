//! Record batch compression, in pure Rust so the plugin builds for wasm32-wasip2 without a C
//! toolchain: gzip (flate2 on miniz_oxide), snappy (snap, raw blocks), lz4 (lz4_flex, the LZ4
//! frame format with independent 64 KiB blocks, as Kafka's reader requires) and zstd (ruzstd,
//! whose encoder offers the fastest level only, about zstd's level 1).

use std::io::Write as _;

use bytes::{BufMut as _, BytesMut};
use kafka_protocol::records::Compression;

/// Parses the `compression` setting.
pub fn parse(value: &str) -> Result<Compression, String> {
    match value.trim() {
        "none" => Ok(Compression::None),
        "gzip" => Ok(Compression::Gzip),
        "snappy" => Ok(Compression::Snappy),
        "lz4" => Ok(Compression::Lz4),
        "zstd" => Ok(Compression::Zstd),
        other => Err(format!("compression: expected none, gzip, snappy, lz4 or zstd, got {other:?}")),
    }
}

/// Compresses the encoded records of one batch with `codec` into `out`: the closure
/// kafka-protocol's batch encoder calls (for every codec, `None` included).
pub fn compress(records: &mut BytesMut, out: &mut BytesMut, codec: Compression) -> anyhow::Result<()> {
    match codec {
        Compression::None => out.put_slice(records),
        Compression::Gzip => {
            let mut encoder = flate2::write::GzEncoder::new(out.writer(), flate2::Compression::fast());
            encoder.write_all(records)?;
            encoder.finish()?;
        }
        // Raw snappy: every Kafka reader (the Java client's xerial stream, librdkafka, tansu)
        // accepts it, where the xerial framing's multi-block form is not read by all.
        Compression::Snappy => {
            let compressed = snap::raw::Encoder::new().compress_vec(records)?;
            out.put_slice(&compressed);
        }
        Compression::Lz4 => {
            use lz4_flex::frame::{BlockMode, BlockSize, FrameEncoder, FrameInfo};
            let info = FrameInfo::new().block_mode(BlockMode::Independent).block_size(BlockSize::Max64KB);
            let mut encoder = FrameEncoder::with_frame_info(info, out.writer());
            encoder.write_all(records)?;
            encoder.finish()?;
        }
        Compression::Zstd => {
            let compressed =
                ruzstd::encoding::compress_to_vec(&records[..], ruzstd::encoding::CompressionLevel::Fastest);
            out.put_slice(&compressed);
        }
    }
    Ok(())
}
