//! `oxibonsai._core`: the thin PyO3 binding over `oxibonsai-core`. Conversions only; every area has
//! its own file, and core errors become Python exceptions in `errors.rs` alone.

mod arrays;
mod errors;
mod gguf;
mod gil;
mod logits;
mod model;
mod plan;
mod prefix;
mod prompt_scores;
mod q1;
mod rope;
mod runtime;
mod sample;
mod sample_rows;
mod sched;
mod small_int;
mod token_ids;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_class::<gguf::GgufFile>()?;
    m.add_class::<q1::Q1Matrix>()?;
    m.add_class::<model::Model>()?;
    m.add_class::<sample::Sampler>()?;
    m.add_class::<prefix::PrefixCache>()?;
    m.add_class::<sched::Scheduler>()?;
    m.add_class::<sched::SchedulerOutput>()?;
    m.add_class::<plan::StepPlan>()?;
    m.add_function(wrap_pyfunction!(sample_rows::sample_rows, m)?)?;
    m.add_function(wrap_pyfunction!(q1::quantize_activations, m)?)?;
    m.add_function(wrap_pyfunction!(prefix::block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(rope::rope_frequencies, m)?)?;
    m.add_function(wrap_pyfunction!(rope::gguf_rope_scaling, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::set_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::get_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::kernel_info, m)?)?;
    Ok(())
}
