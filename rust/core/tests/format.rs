//! The Q1_0 format: bytes, quantization rules, validation.

mod common;

use common::Rng;
use oxibonsai_core::q1::block::as_blocks;
use oxibonsai_core::q1::format::{dequantize, quantize, validate};
use oxibonsai_core::q1::{Q1Matrix, BLOCK_BYTES};

#[test]
fn block_layout_is_scale_then_lsb_first_sign_bits() {
    let mut w = vec![-1.0f32; 128];
    w[0] = 2.0; // bit 0 of byte 0
    w[9] = 0.0; // bit 1 of byte 1 (zero is positive)
    w[127] = -0.0; // bit 7 of byte 15 (negative zero is positive)
    let bytes = quantize(&w, 1, 128).unwrap();
    assert_eq!(bytes.len(), BLOCK_BYTES);
    let mean = (2.0 + 0.0 + 0.0 + 125.0) / 128.0f32;
    assert_eq!(u16::from_le_bytes([bytes[0], bytes[1]]), half::f16::from_f32(mean).to_bits());
    let mut qs = [0u8; 16];
    qs[0] = 0b1;
    qs[1] = 0b10;
    qs[15] = 0b1000_0000;
    assert_eq!(&bytes[2..], &qs);
}

#[test]
fn dequantize_gives_plus_or_minus_the_scale() {
    let mut rng = Rng::fresh("dequantize");
    let w = rng.weights(3 * 256);
    let bytes = quantize(&w, 3, 256).unwrap();
    let mut out = vec![0f32; w.len()];
    dequantize(&bytes, &mut out);
    for (i, (&orig, &dq)) in w.iter().zip(&out).enumerate() {
        let d = as_blocks(&bytes)[i / 128].scale();
        assert_eq!(dq, if orig >= 0.0 { d } else { -d });
    }
}

#[test]
fn validation_names_the_problem() {
    let bytes = quantize(&[1.0; 256], 1, 256).unwrap();
    assert!(validate(&bytes, 1, 256).is_ok());
    assert!(validate(&bytes[1..], 1, 256).unwrap_err().to_string().contains("36 bytes, got 35"));
    assert!(validate(&bytes, 1, 255).unwrap_err().to_string().contains("multiple of 128"));
    let mut nan = bytes.clone();
    nan[18..20].copy_from_slice(&half::f16::NAN.to_le_bytes());
    assert!(Q1Matrix::from_bytes(nan, 1, 256).is_err());
    assert!(quantize(&[7e4; 128], 1, 128).unwrap_err().to_string().contains("fp16"));
    assert!(quantize(&[f32::NAN; 128], 1, 128).is_err());
}
