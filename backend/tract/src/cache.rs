//! The graph cache: each graph's decluttered tract model, kept on disk as NNEF so that a second
//! start skips reading the ONNX protobuf, sanitizing, typing and decluttering.
//!
//! What a start costs without it (0.6B dimensions, fp32, one core of the build machine,
//! `RUST_LOG=backend_tract=debug`): the talker spends 3.4 s reading and parsing its 1.8 GB of
//! protobuf, 0.1 s typing, 0.9 s decluttering and 1.1 s optimizing. Optimizing (kernel selection,
//! weight packing) depends on the CPU and stays on the start path; everything before it is the
//! same on every start and is what this cache stores.
//!
//! An entry is a directory `<cache dir>/<graph>-<plan>-<key>/` holding `model/` (tract's NNEF
//! with its `tract_core`, `tract_onnx` and `herald` extensions; block-quantized weights stay in
//! their Q4_0 form; EinSums, slices and element-wise binary ops are written whole, so the model
//! reads back as it was written rather than as NNEF's primitives to be reassembled) and
//! `io.txt` (the ONNX input and output names in plan order). The key hashes
//! everything that could change what the entry holds: the cache format, this crate's version,
//! tract's version, the running executable (size and modification time, so a rebuilt herald
//! never reads an older herald's entries), the graph's name, manifest checksum, file sizes and
//! modification times, and the plan's fixed frame count. A stale entry is therefore never
//! found; a corrupt one (it fails to load, or its IO differs from the manifest's) is removed
//! with a warning and rebuilt from the ONNX file. Entries are written to a temporary directory
//! beside their final name and renamed into place, so a reader never sees half an entry and
//! two processes starting together both succeed. Entries carry no checksum of their contents
//! (hashing every weight on each start would cost what the cache saves): like the bundle
//! itself, the cache directory is trusted local state; deleting it is always safe.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use tract_nnef::internal::*;
use tract_nnef::tract_core::ops::array::Slice;
use tract_nnef::tract_core::ops::binary::TypedBinOp;
use tract_nnef::tract_core::ops::einsum::EinSum;
use tract_nnef::tract_core::ops::einsum::einsum_matmul::EinSumMatMul;
use tract_nnef::tract_core::ops::konst::Const;
use tract_nnef::tract_core::tract_linalg::block_quant::{BlockQuantFact, BlockQuantStorage};
use tract_onnx::WithOnnx;

use model::manifest::GraphInfo;

use crate::snake::Snake;

/// Bumped whenever the layout of an entry changes (2: EinSums written whole as `herald_einsum`).
const CACHE_FORMAT: u32 = 2;
/// The tract release this crate is built against (Cargo.toml pins it).
const TRACT_VERSION: &str = "0.23.9";

static CACHE_DIR: RwLock<Option<PathBuf>> = RwLock::new(None);

/// Where graph caches live (`runtime.graph_cache_dir`); `None` turns the cache off (the
/// default: a library does not write to disk unless asked). The directory is created on the
/// first write.
pub fn set_graph_cache_dir(dir: Option<PathBuf>) {
    *CACHE_DIR.write().unwrap_or_else(|e| e.into_inner()) = dir;
}

/// The cache directory [`set_graph_cache_dir`] chose, if any.
pub fn graph_cache_dir() -> Option<PathBuf> {
    CACHE_DIR.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// tract's NNEF framework with every extension a herald graph uses after decluttering.
///
/// Built once per process and shared by the graph loader threads: building it parses NNEF's
/// standard library and every registry's fragments with tract's parser, 0.05–0.08 s each time
/// (perf, 0.6B warm start).
fn nnef() -> &'static tract_nnef::framework::Nnef {
    static NNEF: std::sync::OnceLock<tract_nnef::framework::Nnef> = std::sync::OnceLock::new();
    NNEF.get_or_init(|| tract_nnef::nnef().with_onnx().with_registry(herald_registry()))
}

/// The `herald` NNEF extension:
/// - the fused SnakeBeta ([`Snake`]) as `herald_snake(x, a, inv_b)`, and tract's exact GELU
///   (the vocoder's, from ONNX `Erf`), which tract 0.23.9 cannot write to NNEF itself, as
///   `herald_gelu_exact(x)`;
/// - the ops written whole so that they read back unchanged ([`Whole`]):
///   `herald_einsum(inputs, expr, acc)`, `herald_slice(x, axis, start, end)` (bounds as tract
///   writes a `TDim`, symbols included) and `herald_binary(a, b, op)` (`op`: tract's NNEF name
///   of the element-wise binary op, e.g. `"add"`);
/// - `herald_bq_shape(x, shape)`: a block-quantized weight of rank above 2 ([`ShapedBlockQuant`]).
fn herald_registry() -> Registry {
    let mut r =
        Registry::new("herald").with_doc("herald's own ops (the fused SnakeBeta activation, exact GELU) and ops written whole");
    r.register_unit_element_wise("herald_gelu_exact", &tract_nnef::tract_core::ops::nn::GeluExact {});
    r.register_dumper(|ast: &mut IntoAst, node: &TypedNode, _op: &Snake| {
        let inputs: TVec<Arc<RValue>> = node.inputs.iter().map(|i| ast.mapping[i].clone()).collect();
        Ok(Some(invocation("herald_snake", &inputs, &[])))
    });
    r.register_dumper(|ast: &mut IntoAst, node: &TypedNode, op: &Whole<EinSum>| {
        let inputs: Vec<RValue> = node.inputs.iter().map(|i| ast.mapping[i].as_ref().clone()).collect();
        Ok(Some(invocation(
            "herald_einsum",
            &[Arc::new(tract_nnef::ser::array(inputs))],
            &[("expr", string(op.0.axes.to_string())), ("acc", tract_nnef::ser::datum_type(op.0.operating_dt))],
        )))
    });
    r.register_dumper(|ast: &mut IntoAst, node: &TypedNode, op: &ShapedBlockQuant| {
        let flat = ast.konst_variable(&node.name, &op.flat)?;
        Ok(Some(invocation("herald_bq_shape", &[flat], &[("shape", tract_nnef::ser::ints(op.konst.val().shape()))])))
    });
    r.register_primitive(
        "herald_bq_shape",
        &[TypeName::Scalar.tensor().named("x"), TypeName::Integer.array().named("shape")],
        &[("output", TypeName::Scalar.tensor())],
        |builder: &mut ModelBuilder, invocation: &ResolvedInvocation| {
            let x: OutletId = invocation.named_arg_as(builder, "x")?;
            let shape: TVec<usize> = invocation.named_arg_as(builder, "shape")?;
            // a new constant: tract may hand back an equal constant that already existed for the
            // 2-D variable, so that node is left as it is (the declutter on read drops it if
            // nothing uses it)
            let flat = builder.model.outlet_fact(x)?.konst.clone().context("herald_bq_shape: x is not a constant")?;
            let storage = flat.try_storage_as::<BlockQuantStorage>()?;
            ensure!(
                shape.iter().product::<usize>() == flat.len(),
                "herald_bq_shape: cannot give {:?} the shape {shape:?}",
                flat.shape()
            );
            let tensor = storage.clone().into_tensor_with_shape(flat.datum_type(), &shape).into_arc_tensor();
            let fact = BlockQuantFact::new(tract_nnef::tract_core::dyn_clone::clone_box(storage.format()), shape);
            builder.wire(Const::new_with_exotic_fact(tensor, Box::new(fact))?, &[])
        },
    );
    r.register_dumper(|ast: &mut IntoAst, node: &TypedNode, op: &Whole<Slice>| {
        let x = ast.mapping[&node.inputs[0]].clone();
        Ok(Some(invocation(
            "herald_slice",
            &[x],
            &[("axis", numeric(op.0.axis)), ("start", string(op.0.start.to_string())), ("end", string(op.0.end.to_string()))],
        )))
    });
    r.register_dumper(|ast: &mut IntoAst, node: &TypedNode, op: &Whole<TypedBinOp>| {
        let id = std::any::Any::type_id(tract_nnef::tract_core::downcast_rs::Downcast::as_any(&*op.0.0));
        let Some(name) = ast
            .framework
            .registries
            .iter()
            .flat_map(|r| &r.binary_ops)
            .find(|(_, b)| std::any::Any::type_id(tract_nnef::tract_core::downcast_rs::Downcast::as_any(&**b)) == id)
            .map(|(name, _)| name.0.clone())
        else {
            return Ok(None);
        };
        let (a, b) = (ast.mapping[&node.inputs[0]].clone(), ast.mapping[&node.inputs[1]].clone());
        Ok(Some(invocation("herald_binary", &[a, b], &[("op", string(name))])))
    });
    r.register_primitive(
        "herald_binary",
        &[TypeName::Scalar.tensor().named("a"), TypeName::Scalar.tensor().named("b"), TypeName::String.named("op")],
        &[("output", TypeName::Scalar.tensor())],
        |builder: &mut ModelBuilder, invocation: &ResolvedInvocation| {
            let a: OutletId = invocation.named_arg_as(builder, "a")?;
            let b: OutletId = invocation.named_arg_as(builder, "b")?;
            let name: String = invocation.named_arg_as(builder, "op")?;
            let op = builder
                .framework
                .registries
                .iter()
                .flat_map(|r| &r.binary_ops)
                .find(|(id, _)| id.0 == name)
                .map(|(_, op)| tract_nnef::tract_core::dyn_clone::clone_box(&**op))
                .with_context(|| format!("herald_binary: no binary op {name:?}"))?;
            builder.wire(TypedBinOp(op, None), &[a, b])
        },
    );
    r.register_primitive(
        "herald_slice",
        &[
            TypeName::Scalar.tensor().named("x"),
            TypeName::Integer.named("axis"),
            TypeName::String.named("start"),
            TypeName::String.named("end"),
        ],
        &[("output", TypeName::Scalar.tensor())],
        |builder: &mut ModelBuilder, invocation: &ResolvedInvocation| {
            let x: OutletId = invocation.named_arg_as(builder, "x")?;
            let axis: usize = invocation.named_arg_as(builder, "axis")?;
            let (start, end): (String, String) =
                (invocation.named_arg_as(builder, "start")?, invocation.named_arg_as(builder, "end")?);
            let start = builder.model.symbols.parse_tdim(start)?;
            let end = builder.model.symbols.parse_tdim(end)?;
            builder.wire(Slice { axis, start, end }, &[x])
        },
    );
    r.register_primitive(
        "herald_einsum",
        &[TypeName::Scalar.tensor().array().named("inputs"), TypeName::String.named("expr"), TypeName::String.named("acc")],
        &[("output", TypeName::Scalar.tensor())],
        |builder: &mut ModelBuilder, invocation: &ResolvedInvocation| {
            let expr = invocation.named_arg_as::<String>(builder, "expr")?.parse::<AxesMapping>()?;
            let acc: DatumType = invocation.named_arg_as::<String>(builder, "acc")?.parse()?;
            let inputs: TVec<OutletId> = invocation.named_arg_as(builder, "inputs")?;
            builder.wire(EinSum::new(expr, acc), &inputs)
        },
    );
    r.register_primitive(
        "herald_snake",
        &[TypeName::Scalar.tensor().named("x"), TypeName::Scalar.tensor().named("a"), TypeName::Scalar.tensor().named("inv_b")],
        &[("output", TypeName::Scalar.tensor())],
        |builder: &mut ModelBuilder, invocation: &ResolvedInvocation| {
            let x = invocation.named_arg_as(builder, "x")?;
            let a = invocation.named_arg_as(builder, "a")?;
            let inv_b = invocation.named_arg_as(builder, "inv_b")?;
            builder.wire(Snake, &[x, a, inv_b])
        },
    );
    r
}

/// An op on its way to the cache that herald writes itself, so that it reads back as exactly
/// the op that was written: an unquantized [`EinSum`] as `herald_einsum(inputs, expr, acc)`, a
/// [`Slice`] as `herald_slice(x, axis, start, end)` and an element-wise [`TypedBinOp`] as
/// `herald_binary(a, b, op)`.
///
/// tract 0.23.9's NNEF writer turns every matrix-product EinSum into NNEF `matmul` plus the
/// transposes, reshapes and axis insertions/removals that put its operands into matmul order,
/// its reader turns each `slice` into a small graph of casts, clamps and a dynamic slice, and it
/// casts both operands of each binary op. Reading those back gives a model that must be
/// decluttered again: about 2 s of the 0.6B talker's warm start (and a 259 kB `graph.nnef`,
/// now 215 kB). Wrapping the ops hides them from tract's rewrites.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Whole<O>(O);

impl<O: TypedOp + Clone + PartialEq + Eq> Op for Whole<O> {
    fn name(&self) -> StaticName {
        format!("HeraldWhole{}", self.0.name()).into()
    }

    op_as_typed_op!();
}

impl<O: TypedOp + Clone + PartialEq + Eq> EvalOp for Whole<O> {
    fn eval_out_of_plan(&self, inputs: TVec<TValue>) -> TractResult<Option<TVec<TValue>>> {
        self.0.eval_out_of_plan(inputs)
    }

    fn eval(&self, ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        self.0.eval(ctx, inputs)
    }
}

impl<O: TypedOp + Clone + PartialEq + Eq> TypedOp for Whole<O> {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        self.0.output_facts(inputs)
    }

    as_op!();
}

/// A block-quantized constant of rank above 2 on its way to the cache, written as a 2-D
/// variable of one block per row and given its shape back by `herald_bq_shape(x, shape)`.
///
/// Decluttering folds reshapes into an EinSum's operands, so a Q4_0 weight can carry a shape
/// such as `[hidden, heads, head_dim]` (the attention output projection, its input split into
/// heads). tract 0.23.9 writes a block-quantized tensor flattened as `[all but last, last]` but
/// reads it back as `[first, all but first]` and requires whole 32-value blocks along the
/// second, so such a weight does not load when `head_dim` is not a multiple of 32 (the tiny
/// test checkpoints' 16). The blocks themselves run along the flattened rows either way.
#[derive(Debug, Clone, Hash, PartialEq, Eq)]
struct ShapedBlockQuant {
    konst: Const,
    /// The same storage with shape `[blocks, block length]`.
    flat: Arc<Tensor>,
}

impl Op for ShapedBlockQuant {
    fn name(&self) -> StaticName {
        "HeraldShapedBlockQuant".into()
    }

    op_as_typed_op!();
}

impl EvalOp for ShapedBlockQuant {
    fn eval_out_of_plan(&self, _inputs: TVec<TValue>) -> TractResult<Option<TVec<TValue>>> {
        // never folded into a plain Const while the writer prepares the model
        Ok(None)
    }

    fn eval(&self, ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        self.konst.eval(ctx, inputs)
    }
}

impl TypedOp for ShapedBlockQuant {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        self.konst.output_facts(inputs)
    }

    as_op!();
}

/// `model` with each unquantized EinSum (plain or already detected as a matmul), each [`Slice`]
/// and each element-wise binary op on floats wrapped in a [`Whole`] (as [`wrap`] decides), and each block-quantized constant of rank above 2 in a
/// [`ShapedBlockQuant`], for writing.
fn wrap_for_writing(model: &TypedModel) -> TractResult<TypedModel> {
    let mut wrapped = model.clone();
    for (id, node) in model.nodes.iter().enumerate() {
        if let Some(op) = wrap(model, node)? {
            wrapped.nodes[id].op = op;
        }
    }
    Ok(wrapped)
}

/// The op [`wrap_for_writing`] writes in place of `node`'s, or `None` to leave it to tract:
/// quantized EinSums, binary ops with an output type or on anything but float operands (tract's
/// reader corrects the integer type it gives inline `TDim` constants; only its casts do that),
/// and slice bounds or EinSum expressions whose text does not read back as the same value.
fn wrap(model: &TypedModel, node: &TypedNode) -> TractResult<Option<Box<dyn TypedOp>>> {
    if let Some(konst) = node.op_as::<Const>() {
        let t = konst.val();
        let Some(storage) = t.storage_as::<BlockQuantStorage>() else { return Ok(None) };
        if t.rank() <= 2 || !t.len().is_multiple_of(storage.format().block_len()) {
            return Ok(None);
        }
        // rows of one block each: the one 2-D shape tract reads back whatever the real one is
        let block = storage.format().block_len();
        let flat = storage.clone().into_tensor_with_shape(t.datum_type(), &[t.len() / block, block]);
        return Ok(Some(Box::new(ShapedBlockQuant { konst: konst.clone(), flat: flat.into_arc_tensor() })));
    }
    if let Some(op) = node.op_as::<Slice>() {
        let reads_back = |d: &TDim| model.symbols.parse_tdim(d.to_string()).is_ok_and(|back| back == *d);
        return Ok((reads_back(&op.start) && reads_back(&op.end)).then(|| Box::new(Whole(op.clone())) as _));
    }
    if let Some(op) = node.op_as::<TypedBinOp>() {
        let facts = model.node_input_facts(node.id)?;
        let float = facts.iter().all(|f| f.datum_type.is_float() && f.datum_type == facts[0].datum_type);
        return Ok((op.1.is_none() && float).then(|| Box::new(Whole(op.clone())) as _));
    }
    let einsum = if let Some(op) = node.op_as::<EinSum>() {
        op.clone()
    } else if let Some(op) = node.op_as::<EinSumMatMul>() {
        op.op.clone()
    } else {
        return Ok(None);
    };
    let reads_back = einsum.axes.to_string().parse::<AxesMapping>().is_ok_and(|back| back == einsum.axes);
    Ok((einsum.q_params.is_none() && reads_back).then(|| Box::new(Whole(einsum)) as _))
}

/// One cache entry: where it is and what it is for.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    dir: PathBuf,
    /// The bundle directory (canonical) and `<graph>-<plan>`: recorded in the entry so that a
    /// later write can prune what it supersedes.
    bundle: PathBuf,
    slot: String,
}

/// The entry for graph `name` (`info`: its file, checksum and IO in the bundle's manifest) of
/// the bundle `bundle`, plan `frames` (`None`: symbolic), when a cache directory is set.
pub(crate) fn entry(bundle: &Path, name: &str, info: &GraphInfo, frames: Option<usize>) -> Option<Entry> {
    let root = graph_cache_dir()?;
    let file = info.file.as_str();
    let mut h = DefaultHasher::new();
    (CACHE_FORMAT, env!("CARGO_PKG_VERSION"), TRACT_VERSION, name, &info.sha256, frames).hash(&mut h);
    // the IO the manifest declares (names, dtypes, shapes): the ONNX path checks the file
    // against it, so an edited manifest must miss the cache and meet that check
    format!("{:?} {:?}", info.inputs, info.outputs).hash(&mut h);
    let stamp = |p: &Path, h: &mut DefaultHasher| match std::fs::metadata(p) {
        Ok(md) => (true, md.len(), md.modified().ok()).hash(h),
        Err(_) => false.hash(h),
    };
    if let Ok(exe) = std::env::current_exe() {
        stamp(&exe, &mut h);
    }
    let path = bundle.join(file);
    stamp(&path, &mut h);
    stamp(&bundle.join(format!("{file}.data")), &mut h);
    // the bundle's location too: two copies of one bundle get separate entries, so deleting
    // one bundle never leaves entries the other relies on half-known
    let bundle = std::fs::canonicalize(bundle).unwrap_or_else(|_| bundle.to_owned());
    bundle.hash(&mut h);
    let plan = frames.map_or_else(|| "sym".to_string(), |n| format!("f{n}"));
    let safe: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect();
    let slot = format!("{safe}-{plan}");
    Some(Entry { dir: root.join(format!("{slot}-{:016x}", h.finish())), bundle, slot })
}

/// tract's `model_for_path` for an entry's `model` directory, with the graph body read by
/// [`crate::nnef_text`] instead of tract's slower NNEF parser. An entry holds `graph.nnef` and
/// one `.dat` tensor per variable (named by its path without the extension, as tract's
/// `DatLoader` names it); anything else in the directory (a `graph.quant`, say) leaves the
/// whole read to tract.
///
/// # Errors
/// A file that cannot be read, a tensor tract cannot decode, or a graph tract cannot build.
fn read_model(dir: &Path) -> TractResult<TypedModel> {
    fn walk(root: &Path, dir: &Path, text: &mut Option<String>, tensors: &mut Vec<(String, PathBuf)>) -> TractResult<bool> {
        for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
            let entry = entry?;
            let path = entry.path();
            let rel = path.strip_prefix(root)?;
            // tract's reader skips every path with a component starting with "."
            if rel.components().any(|c| c.as_os_str().to_string_lossy().starts_with('.')) {
                continue;
            }
            if entry.file_type()?.is_dir() {
                if !walk(root, &path, text, tensors)? {
                    return Ok(false);
                }
            } else if path.is_dir() {
                // a symbolic link to a directory: tract's directory walk does not follow it
                continue;
            } else if rel == Path::new("graph.nnef") {
                *text = Some(std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?);
            } else if path.extension().is_some_and(|e| e == "dat") {
                let id = tract_nnef::resource::resource_path_to_id(rel)?;
                tensors.push((id, path));
            } else {
                return Ok(false);
            }
        }
        Ok(true)
    }
    let (mut text, mut files) = (None, Vec::new());
    let nnef = nnef();
    if !walk(dir, dir, &mut text, &mut files)? {
        return nnef.model_for_path(dir);
    }
    let text = text.with_context(|| format!("{} has no graph.nnef", dir.display()))?;
    let doc = crate::nnef_text::parse_document(&text)?;
    let mut tensors = std::collections::HashMap::with_capacity(files.len());
    for (id, path) in files {
        let file = std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        let t = tract_nnef::tensors::read_tensor(file).with_context(|| format!("reading tensor {}", path.display()))?;
        tensors.insert(tract_nnef::ast::Identifier(id), std::sync::Arc::new(t));
    }
    let proto = tract_nnef::ast::ProtoModel { doc, tensors, quantization: None, resources: Default::default() };
    proto.validate()?;
    nnef.model_for_proto_model(&proto)
}

impl Entry {
    /// The cached decluttered model and its ONNX IO names, or `None` when there is no entry.
    /// A corrupt entry is removed (with a warning) and reads as `None`.
    pub(crate) fn read(&self, info: &GraphInfo) -> Option<(TypedModel, Vec<String>, Vec<String>)> {
        if !self.dir.is_dir() {
            return None;
        }
        match self.try_read(info) {
            Ok(v) => Some(v),
            Err(e) => {
                log::warn!("graph cache {}: unusable, rebuilding it from the ONNX file: {e:#}", self.dir.display());
                let _ = std::fs::remove_dir_all(&self.dir);
                None
            }
        }
    }

    fn try_read(&self, info: &GraphInfo) -> TractResult<(TypedModel, Vec<String>, Vec<String>)> {
        let io_path = self.dir.join("io.txt");
        let io = std::fs::read_to_string(&io_path).with_context(|| format!("reading {}", io_path.display()))?;
        let mut lines = io.lines();
        let mut names = |what: &str| -> TractResult<Vec<String>> {
            let l = lines.next().with_context(|| format!("io.txt has no {what} line"))?;
            let l = l.strip_prefix(what).and_then(|l| l.strip_prefix('\t')).with_context(|| format!("io.txt: no {what} line"))?;
            Ok(if l.is_empty() { vec![] } else { l.split('\t').map(str::to_owned).collect() })
        };
        let (ins, outs) = (names("inputs")?, names("outputs")?);
        // the names in plan order must be the manifest's, in its order (the ONNX path checked
        // the file against them when it wrote the entry)
        let want = |specs: &[model::manifest::TensorSpec]| specs.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
        ensure!(
            ins == want(&info.inputs) && outs == want(&info.outputs),
            "io.txt names inputs {ins:?} and outputs {outs:?}, the manifest declares {:?} and {:?}",
            want(&info.inputs),
            want(&info.outputs)
        );
        let model_dir = self.dir.join("model");
        let model = read_model(&model_dir)
            // what tract's reader still adds (casts on element-wise operands, the constants of
            // a folded reshape) goes away here; with the ops written whole this costs about
            // 0.1 s for the 0.6B talker, where re-assembling split EinSums cost 2 s
            .and_then(|m| m.into_decluttered())
            .with_context(|| format!("loading {}", model_dir.display()))?;
        ensure!(
            model.inputs.len() == ins.len() && model.outputs.len() == outs.len(),
            "the cached model has {} inputs and {} outputs, the manifest declares {} and {}",
            model.inputs.len(),
            model.outputs.len(),
            ins.len(),
            outs.len()
        );
        Ok((model, ins, outs))
    }

    /// Store `model` (decluttered) with its ONNX IO names. Failures are logged, never fatal:
    /// the graph loaded anyway, only the next start stays slow.
    pub(crate) fn write(&self, model: &TypedModel, inputs: &[String], outputs: &[String]) {
        if let Err(e) = self.try_write(model, inputs, outputs) {
            // an op tract cannot write to NNEF is a fact of the graph, not a fault to repeat
            // as a warning on every start
            let msg = format!("{e:#}");
            // one warning per start is enough for a directory that cannot be written
            static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if msg.contains("No serializer found") {
                log::info!("graph cache {}: this graph cannot be cached ({msg}); it is parsed on every start", self.dir.display());
            } else if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                log::warn!("graph cache {}: not written ({msg}); the next start parses the ONNX files again", self.dir.display());
            } else {
                log::debug!("graph cache {}: not written ({msg})", self.dir.display());
            }
        }
    }

    fn try_write(&self, model: &TypedModel, inputs: &[String], outputs: &[String]) -> TractResult<()> {
        let root = self.dir.parent().context("cache entry has no parent directory")?;
        std::fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
        let name = self.dir.file_name().context("cache entry has no name")?.to_string_lossy().into_owned();
        let tmp = tempfile::Builder::new().prefix(&format!(".{name}.")).tempdir_in(root)?;
        nnef().write_to_dir(&wrap_for_writing(model)?, tmp.path().join("model"))?;
        let mut io = std::fs::File::create(tmp.path().join("io.txt"))?;
        writeln!(io, "inputs\t{}", inputs.join("\t"))?;
        writeln!(io, "outputs\t{}", outputs.join("\t"))?;
        writeln!(io, "bundle\t{}", self.bundle.display())?;
        writeln!(io, "slot\t{}", self.slot)?;
        io.sync_all()?;
        drop(io);
        let tmp = tmp.keep();
        // something that is not an entry directory in the way (a stray file): replace it
        if self.dir.exists() && !self.dir.is_dir() {
            std::fs::remove_file(&self.dir).with_context(|| format!("removing {}", self.dir.display()))?;
        }
        if let Err(e) = std::fs::rename(&tmp, &self.dir) {
            let _ = std::fs::remove_dir_all(&tmp);
            // another process wrote the same entry first: theirs is as good as ours
            if !self.dir.is_dir() {
                return Err(e.into());
            }
        }
        log::debug!("graph cache {}: written", self.dir.display());
        self.prune(root);
        Ok(())
    }

    /// Remove the entries this one supersedes (same bundle, graph and plan: the bundle or
    /// herald changed) and those whose bundle directory no longer exists, so the cache holds
    /// about one copy of each bundle in use.
    fn prune(&self, root: &Path) {
        let Ok(list) = std::fs::read_dir(root) else { return };
        for e in list.flatten() {
            let dir = e.path();
            if dir == self.dir || !dir.is_dir() {
                continue;
            }
            // a temporary entry is renamed within seconds; one an hour old was left by a
            // process that was killed while writing
            if e.file_name().to_string_lossy().starts_with('.') {
                let old = e.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
                if old.is_some_and(|age| age > std::time::Duration::from_secs(3600)) {
                    log::debug!("graph cache {}: removed (left by an interrupted write)", dir.display());
                    let _ = std::fs::remove_dir_all(&dir);
                }
                continue;
            }
            let Ok(io) = std::fs::read_to_string(dir.join("io.txt")) else { continue };
            let field = |k: &str| io.lines().find_map(|l| l.strip_prefix(k).and_then(|l| l.strip_prefix('\t'))).map(str::to_owned);
            let (Some(bundle), Some(slot)) = (field("bundle"), field("slot")) else { continue };
            let gone = !Path::new(&bundle).is_dir();
            if gone || (Path::new(&bundle) == self.bundle && slot == self.slot) {
                log::debug!("graph cache {}: removed (superseded or its bundle is gone)", dir.display());
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tract_nnef::tract_core::axes::AxesMapping;
    use tract_nnef::tract_core::ops::math::add;
    use tract_nnef::tract_core::tract_linalg::block_quant::{BlockQuant, Q4_0};

    /// Values in [-2, 2) from a xorshift sequence.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        crate::xorshift(seed).take(n).map(|s| (s % 4096) as f32 / 1024.0 - 2.0).collect()
    }

    /// The shapes the talker's attention output projection has after decluttering: a Q4_0
    /// weight `[n, heads, head_dim]` (rank 3: a reshape folded into it; head_dim 16 as in the
    /// tiny checkpoints), an EinSum over heads and head_dim, a slice with a symbolic bound and
    /// a broadcast add.
    fn model() -> TypedModel {
        let (n, heads, dim) = (8, 4, 16);
        let mut m = TypedModel::default();
        let s = m.symbols.sym("S");
        let x = m.add_source("x", f32::fact(&[1.to_dim(), s.to_dim(), heads.to_dim(), dim.to_dim()])).unwrap();
        let blob = Q4_0.quant_f32(&values(n * heads * dim, 3)).unwrap();
        let storage = BlockQuantStorage::new(Box::new(Q4_0), n, heads * dim, Arc::new(blob)).unwrap();
        let w = Const::new_with_exotic_fact(
            Arc::new(storage.into_tensor_with_shape(f32::datum_type(), &[n, heads, dim])),
            Box::new(BlockQuantFact::new(Box::new(Q4_0), tvec!(n, heads, dim))),
        )
        .unwrap();
        let w = m.wire_node("w", w, &[]).unwrap()[0];
        let axes = AxesMapping::from_strs(&["abck", "nck"], &["abn"]).unwrap();
        let y = m.wire_node("proj", EinSum::new(axes, f32::datum_type()), &[x, w]).unwrap()[0];
        let y = m.wire_node("tail", Slice { axis: 1, start: 1.to_dim(), end: s.to_dim() }, &[y]).unwrap()[0];
        let bias = m.add_const("bias", tensor3(&[[[0.5f32, -1.0, 0.25, 2.0, 0.0, 1.0, -0.5, 3.0]]])).unwrap();
        let y = m.wire_node("biased", add(), &[y, bias]).unwrap()[0];
        m.select_output_outlets(&[y]).unwrap();
        m.into_decluttered().unwrap()
    }

    /// Op names in evaluation order, counted.
    fn ops(m: &TypedModel) -> std::collections::BTreeMap<String, usize> {
        let mut out = std::collections::BTreeMap::new();
        for n in m.eval_order().unwrap() {
            *out.entry(m.node(n).op.name().to_string()).or_default() += 1;
        }
        out
    }

    fn run(m: &TypedModel, x: &Tensor) -> Tensor {
        let plan = m.clone().into_optimized().unwrap().into_runnable().unwrap();
        plan.run(tvec!(x.clone().into_tvalue())).unwrap().remove(0).into_tensor()
    }

    /// A decluttered model with a rank-3 Q4_0 weight goes through the cache and comes back with
    /// the same ops (before any re-declutter, apart from any casts tract's reader adds) and the
    /// same outputs, bit for bit.
    #[test]
    fn ops_written_whole_read_back_as_written() {
        let model = model();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model");
        nnef().write_to_dir(&wrap_for_writing(&model).unwrap(), &path).unwrap();
        let text = std::fs::read_to_string(path.join("graph.nnef")).unwrap();
        for op in ["herald_einsum(", "herald_slice(", "herald_binary(", "herald_bq_shape("] {
            assert!(text.contains(op), "{op} missing from:\n{text}");
        }
        assert!(!text.contains("matmul("), "an EinSum was split:\n{text}");

        // what tract wrote is read by herald's fast body parser, and reads as tract's parser
        // reads it
        let fast = crate::nnef_text::fast(&text).expect("the written text is inside the fast parser's subset");
        assert_eq!(fast, tract_nnef::ast::parse::parse_document(&text).unwrap());

        let raw = read_model(&path).unwrap();
        assert_eq!(ops(&raw), ops(&nnef().model_for_path(&path).unwrap()), "herald's read and tract's");
        let mut raw_ops = ops(&raw);
        raw_ops.remove("Cast");
        assert_eq!(raw_ops, ops(&model), "as read, before decluttering");
        let back = raw.into_decluttered().unwrap();
        assert_eq!(ops(&back), ops(&model));

        for s in [2usize, 5] {
            let x = Tensor::from_shape(&[1, s, 4, 16], &values(s * 64, s as u64)).unwrap();
            let (want, got) = (run(&model, &x), run(&back, &x));
            assert_eq!(got.shape(), &[1, s - 1, 8]);
            assert_eq!(got, want, "S = {s}");
        }
    }

    /// What [`wrap`] leaves to tract's own writer: a slice bound whose text reads back as
    /// another value (`2 * (S + 1)` prints as `2*S+1`) and a binary op on integers (tract's
    /// reader fixes the type of inline `TDim` constants with its casts).
    #[test]
    fn left_to_tract_when_it_would_not_read_back() {
        let mut m = TypedModel::default();
        let s = m.symbols.sym("S");
        let x = m.add_source("x", f32::fact(&[s.to_dim(), 4.to_dim()])).unwrap();
        let unsimplified = TDim::MulInt(2, Box::new(s.to_dim() + 1));
        let odd = m.wire_node("odd", Slice { axis: 0, start: 0.to_dim(), end: unsimplified }, &[x]).unwrap()[0];
        let plain = m.wire_node("plain", Slice { axis: 0, start: 1.to_dim(), end: s.to_dim() - 1 }, &[x]).unwrap()[0];
        let i = m.add_source("i", i64::fact([3])).unwrap();
        let one = m.add_const("one", tensor1(&[1i64, 1, 1])).unwrap();
        let int_add = m.wire_node("int_add", add(), &[i, one]).unwrap()[0];
        m.select_output_outlets(&[odd, plain, int_add]).unwrap();
        let wrapped = |name: &str| wrap(&m, m.node(m.node_by_name(name).unwrap().id)).unwrap().is_some();
        assert!(!wrapped("odd"), "2*(S+1) would read back as 2*S+1");
        assert!(wrapped("plain"));
        assert!(!wrapped("int_add"));
    }
}
