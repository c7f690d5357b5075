// fa_emu_register.h — turns kernel name expressions into emulator entry points.
//
// flasharray/emulator.py appends, for each name expression EXPR (e.g. `gemm<fa_half, 64>`):
//     extern "C" void fa_emu_entry_<i>(void** args) { auto fn = &EXPR; fa_emu::invoke(fn, args); }
//     extern "C" const char* fa_emu_sig_<i>() { auto fn = &EXPR; return fa_emu::signature(fn); }
// `invoke` calls the kernel with each argument read from args[k] (pointers to the values);
// `signature` describes the parameter types for the Python-side argument check.
#pragma once

#include <string>
#include <type_traits>
#include <utility>

namespace fa_emu {

// Type codes: f16 bf16 f32 f64 b1 i8 u8 i16 u16 i32 u32 i64 u64 v, tmap (a CUtensorMap); pointers are '*' (or '*c' for a
// pointer to const) followed by the pointee's code; anything else is '?<size>'.
template <class T, class = void> struct type_code {
    static std::string get() { return "?" + std::to_string(sizeof(T)); }
};
#define FA_EMU_TYPE_CODE(T, code) \
    template <> struct type_code<T> { static std::string get() { return code; } };
FA_EMU_TYPE_CODE(void, "v")
FA_EMU_TYPE_CODE(bool, "b1")
FA_EMU_TYPE_CODE(char, "i8")
FA_EMU_TYPE_CODE(signed char, "i8")
FA_EMU_TYPE_CODE(unsigned char, "u8")
FA_EMU_TYPE_CODE(short, "i16")
FA_EMU_TYPE_CODE(unsigned short, "u16")
FA_EMU_TYPE_CODE(int, "i32")
FA_EMU_TYPE_CODE(unsigned int, "u32")
FA_EMU_TYPE_CODE(long, "i64")
FA_EMU_TYPE_CODE(unsigned long, "u64")
FA_EMU_TYPE_CODE(long long, "i64")
FA_EMU_TYPE_CODE(unsigned long long, "u64")
FA_EMU_TYPE_CODE(float, "f32")
FA_EMU_TYPE_CODE(double, "f64")
FA_EMU_TYPE_CODE(__half, "f16")
FA_EMU_TYPE_CODE(__nv_bfloat16, "bf16")
FA_EMU_TYPE_CODE(CUtensorMap, "tmap")
#undef FA_EMU_TYPE_CODE
template <class T> struct type_code<T*> {
    static std::string get() {
        return std::string(std::is_const<T>::value ? "*c" : "*") + type_code<std::remove_cv_t<T>>::get();
    }
};

template <class... A, std::size_t... I>
void invoke_impl(void (*fn)(A...), void** args, std::index_sequence<I...>) {
    // Called through a volatile pointer so that no compiler inlines the kernel into its entry
    // point: error messages name barrier sites as `kernel(args)+offset`.
    void (*volatile kernel)(A...) = fn;
    kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}
template <class... A>
void invoke(void (*fn)(A...), void** args) {
    invoke_impl(fn, args, std::index_sequence_for<A...>{});
}

template <class... A>
const char* signature(void (*)(A...)) {
    static const std::string sig = [] {
        std::string s;
        ((s += (s.empty() ? "" : ","), s += type_code<std::remove_cv_t<A>>::get()), ...);
        return s;
    }();
    return sig.c_str();
}

}  // namespace fa_emu
