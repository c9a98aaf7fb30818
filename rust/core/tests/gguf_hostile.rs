//! The GGUF reader on malformed and hostile files: every failure is `Error::Gguf` with a message
//! that names the fault, and no input makes it panic, read out of bounds or allocate without bound.

mod common;

use common::gguf_writer::{build, Raw, TensorSpec};
use common::Rng;
use oxibonsai_core::bytes::SharedBytes;
use oxibonsai_core::gguf::{GgufFile, Value, ValueType, MAX_ARRAY_NESTING};
use oxibonsai_core::Error;

fn parse(bytes: Vec<u8>) -> oxibonsai_core::Result<GgufFile> {
    GgufFile::from_bytes(SharedBytes::from_vec(bytes))
}

/// The `Error::Gguf` message for `bytes`, failing the test on success or another variant.
fn gguf_error(bytes: Vec<u8>) -> String {
    match parse(bytes) {
        Err(Error::Gguf(msg)) => msg,
        Err(other) => panic!("expected Error::Gguf, got {other:?}"),
        Ok(_) => panic!("expected Error::Gguf, the file parsed"),
    }
}

fn assert_error(bytes: Vec<u8>, needles: &[&str]) {
    let msg = gguf_error(bytes);
    for needle in needles {
        assert!(msg.contains(needle), "{msg:?} should contain {needle:?}");
    }
}

/// A small valid file with metadata of several types and three tensors.
fn small_valid_file() -> Vec<u8> {
    let kvs = [
        ("general.architecture", Value::String("qwen3".into())),
        ("qwen3.block_count", Value::U32(1)),
        ("eps", Value::F32(1e-6)),
        ("flag", Value::Bool(true)),
        ("tokens", Value::Array(ValueType::String, vec![Value::String("a".into()), Value::String("bc".into())])),
        ("nested", Value::Array(ValueType::Array, vec![Value::Array(ValueType::I8, vec![Value::I8(-1)])])),
    ];
    let tensors = [
        TensorSpec::new("w", &[128, 2], 41, vec![7; 36]),
        TensorSpec::new("norm", &[4], 0, vec![1; 16]),
        TensorSpec::new("h", &[2], 1, vec![2; 4]),
    ];
    build(&kvs, &tensors, 32)
}

#[test]
fn truncation_at_every_offset_is_a_gguf_error() {
    let full = small_valid_file();
    assert!(parse(full.clone()).is_ok());
    for len in 0..full.len() {
        gguf_error(full[..len].to_vec());
    }
}

#[test]
fn random_byte_flips_never_panic() {
    let mut rng = Rng::fresh("flips");
    let full = small_valid_file();
    let (mut ok, mut err) = (0, 0);
    for _ in 0..20_000 {
        let mut bytes = full.clone();
        for _ in 0..1 + rng.next_u64() % 4 {
            let at = (rng.next_u64() % bytes.len() as u64) as usize;
            bytes[at] = if rng.next_u64().is_multiple_of(4) { 0xff } else { rng.next_u64() as u8 };
        }
        match parse(bytes) {
            Ok(_) => ok += 1,
            Err(Error::Gguf(_)) => err += 1,
            Err(other) => panic!("a corrupt file must be Error::Gguf, got {other:?}"),
        }
    }
    println!("{ok} parsed, {err} refused");
    assert!(err > 0);
}

#[test]
fn bad_magic_and_versions_are_named() {
    assert_error(b"GGML\x03\0\0\0".to_vec(), &["not a GGUF file"]);
    let mut raw = Raw::default();
    raw.header(1, 0, 0);
    assert_error(raw.0, &["unsupported GGUF version 1"]);
    let mut raw = Raw::default();
    raw.header(4, 0, 0);
    assert_error(raw.0, &["unsupported GGUF version 4"]);
    let mut raw = Raw::default();
    raw.header(3u32.swap_bytes(), 0, 0);
    assert_error(raw.0, &["big-endian"]);
}

#[test]
fn counts_the_file_cannot_hold_are_refused_before_allocating() {
    for (n_tensors, n_kv) in [(0, u64::MAX), (0, 1 << 40), (u64::MAX / 2, 0), (u64::MAX / 32 + 1, 1)] {
        let mut raw = Raw::default();
        raw.header(3, n_tensors, n_kv).bytes(&[0; 64]);
        assert_error(raw.0, &["more than the 64 bytes"]);
    }
}

#[test]
fn huge_string_lengths_are_refused() {
    let mut raw = Raw::default();
    raw.header(3, 0, 1).u64(u64::MAX).bytes(b"key, then more bytes");
    assert_error(raw.0, &["metadata entry #0", "claims 18446744073709551615 bytes"]);
    let mut raw = Raw::default();
    raw.header(3, 0, 1).string(b"k").u32(8).u64(1 << 50).bytes(&[b'x'; 16]);
    assert_error(raw.0, &["metadata key 'k'", "claims 1125899906842624 bytes"]);
}

#[test]
fn huge_array_counts_are_refused() {
    for (elem, count) in [(0u32, 1u64 << 40), (8, u64::MAX), (10, u64::MAX / 8 + 1), (9, 1 << 30)] {
        let mut raw = Raw::default();
        raw.header(3, 0, 1).string(b"arr").u32(9).u32(elem).u64(count).bytes(&[0; 32]);
        assert_error(raw.0, &["metadata key 'arr'", "elements but only 32 bytes remain"]);
    }
}

fn nested_array(levels: usize) -> Value {
    let mut v = Value::Array(ValueType::U8, vec![Value::U8(1)]);
    for _ in 1..levels {
        v = Value::Array(ValueType::Array, vec![v]);
    }
    v
}

#[test]
fn nesting_is_limited() {
    assert!(parse(build(&[("deep", nested_array(MAX_ARRAY_NESTING))], &[], 32)).is_ok());
    let too_deep = build(&[("deep", nested_array(MAX_ARRAY_NESTING + 1))], &[], 32);
    assert_error(too_deep, &["metadata key 'deep'", "nested 9 deep"]);
    // A long chain of one-element arrays stops at the limit, not at the end of the stack.
    let mut raw = Raw::default();
    raw.header(3, 0, 1).string(b"chain").u32(9);
    for _ in 0..100_000 {
        raw.u32(9).u64(1);
    }
    assert_error(raw.0, &["nested 9 deep"]);
}

#[test]
fn bad_values_are_named() {
    let mut raw = Raw::default();
    raw.header(3, 0, 1).string(b"t").u32(13).u32(0);
    assert_error(raw.0, &["metadata key 't'", "unknown value type 13"]);
    let mut raw = Raw::default();
    raw.header(3, 0, 1).string(b"arr").u32(9).u32(77).u64(0).bytes(&[0; 8]);
    assert_error(raw.0, &["metadata key 'arr'", "unknown value type 77"]);
    let mut raw = Raw::default();
    raw.header(3, 0, 1).string(b"b").u32(7).bytes(&[2]);
    assert_error(raw.0, &["metadata key 'b'", "is 2, not 0 or 1"]);
    let mut raw = Raw::default();
    raw.header(3, 0, 1).string(b"s").u32(8).string(&[b'o', 0xc3, 0x28]);
    assert_error(raw.0, &["metadata key 's'", "not valid UTF-8"]);
    let mut raw = Raw::default();
    raw.header(3, 0, 1).string(&[0xff, 0xfe]).u32(0).bytes(&[0]);
    assert_error(raw.0, &["metadata entry #0", "not valid UTF-8"]);
    let dup = build(&[("a", Value::U8(1)), ("a", Value::U8(2))], &[], 32);
    assert_error(dup, &["duplicate metadata key 'a'"]);
}

#[test]
fn bad_alignments_are_refused() {
    for (value, needle) in [
        (Value::U32(0), "is 0, not a nonzero power of two"),
        (Value::U32(48), "is 48, not a nonzero power of two"),
        (Value::U64(32), "must be a u32, found u64 32"),
        (Value::String("32".into()), "must be a u32, found string"),
    ] {
        assert_error(build(&[("general.alignment", value)], &[], 32), &["general.alignment", needle]);
    }
}

fn one_tensor(name: &str, dims: &[u64], type_id: u32, nbytes: usize) -> Vec<u8> {
    build(&[], &[TensorSpec::new(name, dims, type_id, vec![0; nbytes])], 32)
}

#[test]
fn bad_tensor_infos_are_named() {
    assert_error(
        one_tensor("blk.0.attn_q.weight", &[128], 99, 18),
        &["tensor 'blk.0.attn_q.weight' has unknown ggml type 99"],
    );
    assert_error(one_tensor("t", &[], 0, 0), &["tensor 't'", "has 0 dimensions"]);
    assert_error(one_tensor("t", &[1, 1, 1, 1, 1], 0, 4), &["tensor 't'", "has 5 dimensions"]);
    assert_error(one_tensor("t", &[4, 0], 0, 0), &["tensor 't'", "zero dimension"]);
    assert_error(one_tensor("t", &[1 << 32, 1 << 32], 0, 8), &["tensor 't'", "element count overflows"]);
    assert_error(one_tensor("t", &[1 << 40, 1 << 22], 0, 8), &["tensor 't'", "byte size overflows"]);
    assert_error(one_tensor("t", &[100, 2], 41, 36), &["tensor 't'", "100 columns", "Q1_0 block size 128"]);
    let mut raw = Raw::default();
    raw.header(3, 1, 0).string(b"t").u32(u32::MAX).bytes(&[0; 40]);
    assert_error(raw.0, &["tensor 't'", "has 4294967295 dimensions"]);
}

#[test]
fn tensor_placement_is_checked() {
    let beyond = build(&[], &[TensorSpec::new("far", &[4], 0, vec![0; 16])], 32);
    let mut raw = Raw(beyond);
    let len = raw.0.len();
    raw.0.truncate(len - 1);
    assert_error(raw.0, &["tensor 'far'", "lies outside the file"]);
    let far = build(&[], &[TensorSpec::new("far", &[4], 0, vec![]).at(1 << 20)], 32);
    assert_error(far, &["tensor 'far'", "lies outside the file"]);
    let wrap = build(&[], &[TensorSpec::new("wrap", &[4], 0, vec![]).at(u64::MAX - 31)], 32);
    assert_error(wrap, &["tensor 'wrap'", "lies outside the file"]);
    let misaligned = build(&[], &[TensorSpec::new("m", &[4], 0, vec![0; 16]).at(4)], 32);
    assert_error(misaligned, &["tensor 'm'", "offset 4", "not a multiple of the alignment 32"]);
    let overlap = build(
        &[],
        &[TensorSpec::new("a", &[16], 0, vec![0; 64]), TensorSpec::new("b", &[4], 0, vec![0; 16]).at(32)],
        32,
    );
    assert_error(overlap, &["tensors 'a'", "and 'b'", "overlap"]);
    let dup = build(&[], &[TensorSpec::new("d", &[4], 0, vec![0; 16]), TensorSpec::new("d", &[4], 0, vec![0; 16])], 32);
    assert_error(dup, &["duplicate tensor 'd'"]);
}

#[test]
fn shared_data_at_one_offset_is_an_overlap_but_adjacent_tensors_are_fine() {
    let same = build(
        &[("general.alignment", Value::U32(1))],
        &[TensorSpec::new("x", &[1], 24, vec![1]).at(0), TensorSpec::new("y", &[1], 24, vec![2]).at(0)],
        1,
    );
    assert_error(same, &["overlap"]);
    let adjacent = build(
        &[("general.alignment", Value::U32(1))],
        &[TensorSpec::new("x", &[1], 24, vec![1]), TensorSpec::new("y", &[3], 24, vec![2, 3, 4])],
        1,
    );
    let file = parse(adjacent).unwrap();
    assert_eq!(&*file.tensor_bytes(file.tensor("y").unwrap()), &[2, 3, 4]);
}
