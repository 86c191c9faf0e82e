//! Compiles the .proto files with protox (pure Rust, no system protoc) and generates
//! the prost messages and tonic services.
fn main() -> anyhow::Result<()> {
    let protos = ["proto/rune/v1/localapi.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
