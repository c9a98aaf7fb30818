//! The GGUF reader on well-formed files: every value type, tensor tables, alignment, typed lookups,
//! zero-copy tensor bytes, and opening files from disk.

mod common;

use common::gguf_writer::{build, TensorSpec};
use common::Rng;
use oxibonsai_core::bytes::SharedBytes;
use oxibonsai_core::gguf::{GgmlType, GgufFile, Value, ValueType};
use oxibonsai_core::Error;

fn parse(bytes: Vec<u8>) -> oxibonsai_core::Result<GgufFile> {
    GgufFile::from_bytes(SharedBytes::from_vec(bytes))
}

fn every_value_type() -> Vec<(&'static str, Value)> {
    let strings = Value::Array(ValueType::String, vec![Value::String("a".into()), Value::String("ü ✓".into())]);
    let nested = Value::Array(
        ValueType::Array,
        vec![
            Value::Array(ValueType::I16, vec![Value::I16(-2), Value::I16(3)]),
            Value::Array(ValueType::Bool, vec![]),
            Value::Array(ValueType::Array, vec![Value::Array(ValueType::F64, vec![Value::F64(0.25)])]),
        ],
    );
    vec![
        ("u8", Value::U8(200)),
        ("i8", Value::I8(-100)),
        ("u16", Value::U16(60000)),
        ("i16", Value::I16(-30000)),
        ("u32", Value::U32(4_000_000_000)),
        ("i32", Value::I32(-2_000_000_000)),
        ("u64", Value::U64(u64::MAX)),
        ("i64", Value::I64(i64::MIN)),
        ("f32", Value::F32(1e-6)),
        ("f64", Value::F64(-2.5e300)),
        ("true", Value::Bool(true)),
        ("false", Value::Bool(false)),
        ("string", Value::String("Grüße, 世界".into())),
        ("empty.string", Value::String(String::new())),
        ("empty.array", Value::Array(ValueType::U32, vec![])),
        ("strings", strings),
        ("nested", nested),
    ]
}

#[test]
fn every_value_type_round_trips_in_file_order() {
    let kvs = every_value_type();
    let file = parse(build(&kvs, &[], 32)).unwrap();
    assert_eq!(file.version(), 3);
    let got: Vec<(&str, &Value)> = file.metadata().iter().map(|(k, v)| (k.as_str(), v)).collect();
    let want: Vec<(&str, &Value)> = kvs.iter().map(|(k, v)| (*k, v)).collect();
    assert_eq!(got, want);
    assert_eq!(file.get("empty.array"), Some(&Value::Array(ValueType::U32, vec![])));
    assert_eq!(file.get("absent"), None);
    assert!(file.tensors().is_empty());
}

#[test]
fn typed_lookups_convert_and_name_the_key() {
    let file = parse(build(&every_value_type(), &[], 32)).unwrap();
    assert_eq!(file.get_u64("u8"), Ok(Some(200)));
    assert_eq!(file.get_u64("u64"), Ok(Some(u64::MAX)));
    assert_eq!(file.get_f64("f32"), Ok(Some(1e-6f32 as f64)));
    assert_eq!(file.get_f64("u32"), Ok(Some(4e9)));
    assert_eq!(file.get_str("string"), Ok(Some("Grüße, 世界")));
    assert_eq!(file.get_bool("true"), Ok(Some(true)));
    assert_eq!(file.get_array("strings").unwrap().map(<[Value]>::len), Some(2));
    assert_eq!(file.require_u64("u16"), Ok(60000));
    assert_eq!(
        file.require_str("qwen3.block_count"),
        Err(Error::Gguf("missing metadata key 'qwen3.block_count'".into()))
    );
    let err = file.get_u64("i64").unwrap_err().to_string();
    assert!(err.contains("'i64'") && err.contains("non-negative integer") && err.contains("i64 -9223372036854775808"));
    let err = file.require_f64("string").unwrap_err().to_string();
    assert!(err.contains("'string' must be a number, found string"), "{err}");
    assert!(file.get_bool("u8").unwrap_err().to_string().contains("must be a bool, found u8 200"));
}

fn q1_bytes(rng: &mut Rng, rows: u64, cols: u64) -> Vec<u8> {
    (0..rows * cols / 128 * 18).map(|_| rng.next_u64() as u8).collect()
}

fn random_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

fn model_like_tensors(rng: &mut Rng) -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("token_embd.weight", &[256, 5], 41, q1_bytes(rng, 5, 256)),
        TensorSpec::new("blk.0.attn_norm.weight", &[256], 0, random_bytes(rng, 256 * 4)),
        TensorSpec::new("blk.0.attn_q.weight", &[128, 3], 41, q1_bytes(rng, 3, 128)),
        TensorSpec::new("half", &[3, 2], 1, random_bytes(rng, 12)),
        TensorSpec::new("bf", &[5], 30, random_bytes(rng, 10)),
        TensorSpec::new("cube", &[2, 3, 4, 5], 24, random_bytes(rng, 120)),
    ]
}

fn check_tensors(file: &GgufFile, specs: &[TensorSpec]) {
    assert_eq!(file.tensors().len(), specs.len());
    for (info, spec) in file.tensors().iter().zip(specs) {
        assert_eq!(info.name, spec.name);
        assert_eq!(info.dims, spec.dims);
        assert_eq!(info.ggml_type.id(), spec.type_id);
        assert_eq!(info.nbytes, spec.data.len() as u64);
        assert_eq!(info.offset % file.alignment(), 0);
        assert!(info.offset >= file.data_offset());
        assert_eq!(&*file.tensor_bytes(info), &spec.data[..]);
        assert_eq!(file.tensor(&spec.name), Some(info));
    }
}

#[test]
fn tensors_read_back_with_the_default_alignment() {
    let mut rng = Rng::fresh("default alignment");
    let specs = model_like_tensors(&mut rng);
    let file = parse(build(&[("general.architecture", Value::String("qwen3".into()))], &specs, 32)).unwrap();
    assert_eq!(file.alignment(), 32);
    assert_eq!(file.data_offset() % 32, 0);
    check_tensors(&file, &specs);
    let q = file.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(
        (q.ggml_type, q.rows(), q.cols(), q.n_elements(), q.shape()),
        (GgmlType::Q1_0, 3, 128, 384, vec![3, 128])
    );
    assert_eq!(file.tensor("cube").unwrap().rows(), 60);
    assert_eq!(file.tensor("missing"), None);
}

#[test]
fn tensors_read_back_with_custom_alignments() {
    let mut rng = Rng::fresh("custom alignment");
    for alignment in [1u32, 8, 64, 4096] {
        let specs = model_like_tensors(&mut rng);
        let kvs = [("general.alignment", Value::U32(alignment))];
        let file = parse(build(&kvs, &specs, alignment.into())).unwrap();
        assert_eq!(file.alignment(), u64::from(alignment));
        assert_eq!(file.data_offset() % u64::from(alignment), 0);
        check_tensors(&file, &specs);
    }
}

#[test]
fn tensor_bytes_outlive_the_file() {
    let mut rng = Rng::fresh("outlive");
    let specs = model_like_tensors(&mut rng);
    let file = parse(build(&[], &specs, 32)).unwrap();
    let bytes = file.tensor_bytes(&file.tensors()[0]);
    drop(file);
    assert_eq!(&*bytes, &specs[0].data[..]);
}

#[test]
fn version_2_is_read_like_version_3() {
    let mut bytes = build(&[("k", Value::U8(1))], &[], 32);
    bytes[4] = 2;
    assert_eq!(parse(bytes).unwrap().version(), 2);
}

fn temp_path(name: &str) -> std::path::PathBuf {
    let mut rng = Rng::fresh(name);
    std::env::temp_dir().join(format!("oxibonsai-{name}-{}-{:x}.gguf", std::process::id(), rng.next_u64()))
}

#[test]
fn open_maps_a_file_from_disk() {
    let mut rng = Rng::fresh("open");
    let specs = model_like_tensors(&mut rng);
    let path = temp_path("open");
    std::fs::write(&path, build(&every_value_type(), &specs, 32)).unwrap();
    let file = GgufFile::open(&path);
    std::fs::remove_file(&path).unwrap();
    let file = file.unwrap();
    check_tensors(&file, &specs);
    assert_eq!(file.get_str("string"), Ok(Some("Grüße, 世界")));
}

#[test]
fn open_maps_os_errors_and_names_the_path() {
    let missing = temp_path("missing");
    assert!(matches!(GgufFile::open(&missing), Err(Error::NotFound(msg)) if msg.contains("oxibonsai-missing")));
    assert!(matches!(GgufFile::open(&std::env::temp_dir()), Err(Error::Io(_))));
    let path = temp_path("text");
    std::fs::write(&path, "hello, this is not a model\n").unwrap();
    let err = GgufFile::open(&path);
    std::fs::write(&path, "").unwrap();
    let empty = GgufFile::open(&path);
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(err, Err(Error::Gguf(msg)) if msg.contains("oxibonsai-text") && msg.contains("not a GGUF file")));
    assert!(matches!(empty, Err(Error::Gguf(msg)) if msg.contains("truncated")));
}
