//! The command line.

pub(super) struct Args {
    pub(super) host_gb: f64,
    pub(super) steps: usize,
    pub(super) warmup: usize,
    pub(super) rho: f64,
    pub(super) contexts: Vec<u32>,
    pub(super) ks: Vec<u32>,
    pub(super) batches: Vec<u32>,
    pub(super) json: Option<String>,
    pub(super) sum_bf16: bool,
    /// The sketch selector's candidates (None: the key bound).
    pub(super) sketch: Option<u32>,
    /// Print select_score's phase breakdown (needs KVTIER_NVRTC_DEFINES=-DSEL_TRACE=1).
    pub(super) trace: bool,
    /// Time the split pass by step only.
    pub(super) split_step: bool,
    /// fp32 attention on the CUDA cores instead of tensor cores.
    pub(super) simt: bool,
    /// No programmatic dependent launch between layers.
    pub(super) no_pdl: bool,
    /// Skip the dense baselines.
    pub(super) no_dense: bool,
    /// Tokens per block; the sink (128 tokens) and the local window (512) keep their size.
    pub(super) bt: u32,
}

pub(super) fn parse() -> Result<Args, String> {
    let mut a = Args {
        host_gb: 60.2,
        steps: 20,
        warmup: 3,
        rho: 0.9,
        contexts: vec![131_072, 1_048_576],
        ks: vec![8, 32],
        batches: vec![1, 8],
        json: None,
        sum_bf16: false,
        sketch: None,
        trace: false,
        split_step: false,
        simt: false,
        no_pdl: false,
        no_dense: false,
        bt: 128,
    };
    let mut it = std::env::args().skip(1);
    let list = |s: String| -> Result<Vec<u32>, String> {
        s.split(',')
            .map(|x| x.parse::<u32>().map_err(|e| e.to_string()))
            .collect()
    };
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or(format!("{k} needs a value"));
        match k.as_str() {
            "--host-gb" => a.host_gb = v()?.parse().map_err(|e| format!("{e}"))?,
            "--steps" => a.steps = v()?.parse().map_err(|e| format!("{e}"))?,
            "--warmup" => a.warmup = v()?.parse().map_err(|e| format!("{e}"))?,
            "--rho" => a.rho = v()?.parse().map_err(|e| format!("{e}"))?,
            "--contexts" => a.contexts = list(v()?)?,
            "--ks" => a.ks = list(v()?)?,
            "--batches" => a.batches = list(v()?)?,
            "--json" => a.json = Some(v()?),
            "--summaries-bf16" => a.sum_bf16 = true,
            "--sketch" => a.sketch = Some(v()?.parse().map_err(|e| format!("{e}"))?),
            "--trace" => a.trace = true,
            "--split-step" => a.split_step = true,
            "--simt-attention" => a.simt = true,
            "--no-pdl" => a.no_pdl = true,
            "--no-dense" => a.no_dense = true,
            "--block-tokens" => a.bt = v()?.parse().map_err(|e| format!("{e}"))?,
            _ => return Err(format!("unknown argument {k}")),
        }
    }
    Ok(a)
}
