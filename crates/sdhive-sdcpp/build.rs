//! Compiles the C++ shim around stable-diffusion.cpp's generate_image (shim/generate.cpp): it turns a stop
//! request from the progress callback into an unwind of sd.cpp's sampling loop and keeps C++ exceptions out of
//! Rust. It links against the library diffusion-rs-sys builds (and the C++ runtime it links).

fn main() {
    println!("cargo:rerun-if-changed=shim/generate.cpp");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("shim/generate.cpp")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .compile("sdhive_sdcpp_shim");
}
