/* Forced into every llama.cpp translation unit of the wheel's build (and llama-server's, for the
 * same flags): scripts/llama_cpp_build.sh, LCP_CFLAGS.
 *
 * ggml-cpu converts fp16 to fp32 through a table of its own (simd-mappings.h: the x86 build with
 * F16C defines only the vector conversion, the scalar one reads ggml_table_f32_f16), declared
 * there with default visibility. In a shared library such a variable may be interposed, so every
 * kernel reaches it through the GOT: a load the compiler keeps inside hot loops, and a different
 * register allocation around it (tinyBLAS's q5_0 gemm, most of a Gemma prompt's prefill). Nothing
 * outside libggml-cpu reads these tables; declared hidden here, before ggml's own declaration,
 * they are addressed directly, as in llama-server's static build, and the kernels' code is that
 * build's again (docs/performance.md, "ggml-cpu's tables, hidden", has what it gives).
 *
 * Written for the pinned llama-cpp-python (scripts/llama_cpp_build.sh, LCP_VERSION): a llama.cpp
 * that declared these tables otherwise would fail to compile here, not misbehave.
 */
#ifdef __cplusplus
extern "C" {
#endif
extern float ggml_table_f32_f16[1 << 16] __attribute__((visibility("hidden")));
extern float ggml_table_f32_e8m0_half[1 << 8] __attribute__((visibility("hidden")));
extern float ggml_table_f32_ue4m3[1 << 8] __attribute__((visibility("hidden")));
#ifdef __cplusplus
}
#endif
