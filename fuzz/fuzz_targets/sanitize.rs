//! The ONNX sanitizer on mutated graphs: any protobuf that decodes as a `ModelProto` is
//! sanitized without a panic, and the result encodes to a protobuf that decodes again.

#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use tract_onnx::pb::ModelProto;

fuzz_target!(|data: &[u8]| {
    let Ok(mut model) = ModelProto::decode(data) else { return };
    let _ = backend_tract::sanitize::sanitize(&mut model);
    let bytes = model.encode_to_vec();
    let mut again = match ModelProto::decode(bytes.as_slice()) {
        Ok(m) => m,
        Err(e) => panic!("the sanitized model does not decode again: {e}"),
    };
    let _ = backend_tract::sanitize::sanitize(&mut again);
});
