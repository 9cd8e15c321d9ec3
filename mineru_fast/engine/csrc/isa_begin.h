// Included by an instruction-set translation unit after its standard headers, with ISA_TARGET
// defined: every function after it is compiled for that target (GCC's and Clang's spelling), and
// the file's code exists only on x86-64 (elsewhere module.cpp never selects it).
#if defined(__x86_64__)
#define MINERU_FAST_X86 1
#define MINERU_FAST_STRING(x) #x
#define MINERU_FAST_PRAGMA(x) _Pragma(MINERU_FAST_STRING(x))
#if defined(__clang__)
MINERU_FAST_PRAGMA(clang attribute push(__attribute__((target(ISA_TARGET))), apply_to = function))
#elif defined(__GNUC__)
#pragma GCC push_options
MINERU_FAST_PRAGMA(GCC target(ISA_TARGET))
#endif
#include <immintrin.h>
#endif
