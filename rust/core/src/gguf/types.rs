//! ggml tensor types: ids, names and storage sizes, from ggml's type list (the `gguf` Python
//! package's `GGML_QUANT_SIZES`). A type stores `block_size` elements in `type_size` bytes, and a
//! row of a tensor is always a whole number of blocks.

/// A ggml tensor type; the discriminant is the id stored in the file.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
    NVFP4 = 40,
    Q1_0 = 41,
}

/// `(type, name, block_size, type_size)` for every type this reader knows.
const GGML_TYPES: [(GgmlType, &str, u64, u64); 34] = [
    (GgmlType::F32, "F32", 1, 4),
    (GgmlType::F16, "F16", 1, 2),
    (GgmlType::Q4_0, "Q4_0", 32, 18),
    (GgmlType::Q4_1, "Q4_1", 32, 20),
    (GgmlType::Q5_0, "Q5_0", 32, 22),
    (GgmlType::Q5_1, "Q5_1", 32, 24),
    (GgmlType::Q8_0, "Q8_0", 32, 34),
    (GgmlType::Q8_1, "Q8_1", 32, 40),
    (GgmlType::Q2_K, "Q2_K", 256, 84),
    (GgmlType::Q3_K, "Q3_K", 256, 110),
    (GgmlType::Q4_K, "Q4_K", 256, 144),
    (GgmlType::Q5_K, "Q5_K", 256, 176),
    (GgmlType::Q6_K, "Q6_K", 256, 210),
    (GgmlType::Q8_K, "Q8_K", 256, 292),
    (GgmlType::IQ2_XXS, "IQ2_XXS", 256, 66),
    (GgmlType::IQ2_XS, "IQ2_XS", 256, 74),
    (GgmlType::IQ3_XXS, "IQ3_XXS", 256, 98),
    (GgmlType::IQ1_S, "IQ1_S", 256, 50),
    (GgmlType::IQ4_NL, "IQ4_NL", 32, 18),
    (GgmlType::IQ3_S, "IQ3_S", 256, 110),
    (GgmlType::IQ2_S, "IQ2_S", 256, 82),
    (GgmlType::IQ4_XS, "IQ4_XS", 256, 136),
    (GgmlType::I8, "I8", 1, 1),
    (GgmlType::I16, "I16", 1, 2),
    (GgmlType::I32, "I32", 1, 4),
    (GgmlType::I64, "I64", 1, 8),
    (GgmlType::F64, "F64", 1, 8),
    (GgmlType::IQ1_M, "IQ1_M", 256, 56),
    (GgmlType::BF16, "BF16", 1, 2),
    (GgmlType::TQ1_0, "TQ1_0", 256, 54),
    (GgmlType::TQ2_0, "TQ2_0", 256, 66),
    (GgmlType::MXFP4, "MXFP4", 32, 17),
    (GgmlType::NVFP4, "NVFP4", 64, 36),
    (GgmlType::Q1_0, "Q1_0", 128, 18),
];

impl GgmlType {
    /// The type with this id, if this reader knows it.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GGML_TYPES.iter().find(|row| row.0 as u32 == id).map(|row| row.0)
    }

    fn row(self) -> (GgmlType, &'static str, u64, u64) {
        // Every variant has exactly one row (checked by a test), so the fallback is never used.
        GGML_TYPES.iter().copied().find(|row| row.0 == self).unwrap_or((self, "?", 1, 1))
    }

    /// The id stored in the file.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// ggml's name: "F32", "Q1_0", "Q4_K", ...
    pub fn name(&self) -> &'static str {
        self.row().1
    }

    /// Elements per block (1 for plain types, 128 for Q1_0).
    pub fn block_size(&self) -> u64 {
        self.row().2
    }

    /// Bytes per block.
    pub fn type_size(&self) -> u64 {
        self.row().3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_round_trips_through_its_id() {
        for (ty, name, block, size) in GGML_TYPES {
            assert_eq!(GgmlType::from_id(ty.id()), Some(ty));
            assert_eq!((ty.name(), ty.block_size(), ty.type_size()), (name, block, size));
        }
        assert_eq!(GgmlType::from_id(4), None);
        assert_eq!(GgmlType::from_id(99), None);
    }

    #[test]
    fn q1_0_matches_the_q1_module() {
        assert_eq!(GgmlType::Q1_0.id(), crate::q1::GGML_TYPE_Q1_0);
        assert_eq!(GgmlType::Q1_0.block_size() as usize, crate::q1::BLOCK_WEIGHTS);
        assert_eq!(GgmlType::Q1_0.type_size() as usize, crate::q1::BLOCK_BYTES);
    }
}
