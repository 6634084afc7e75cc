//! `history` (issue 22): what `[history] keep` costs the drain. One `timeoutd run` drains the
//! same number of due records with history off and on, alternated (off, on, on, off) so that
//! drift in the machine's load falls on both, each in a fresh database and queue. Rows
//! `history-off` and `history-on` carry the better of each pair, and `history-on`'s details
//! the ratio on/off, every run and the history rows written.

use super::*;

const KEEP: &str = "7d";

pub(crate) async fn scenario(ctx: &Ctx, n: u64) -> Result<Vec<Row>> {
    let mut runs: Vec<(bool, Row)> = Vec::new();
    for (i, on) in [false, true, true, false].into_iter().enumerate() {
        let key = format!("history-{}-{i}", if on { "on" } else { "off" });
        let scen = Scen::new(ctx, &key).await?;
        let extra: Vec<(String, String)> = if on {
            vec![("TIMEOUTD_HISTORY__KEEP".into(), KEEP.into())]
        } else {
            Vec::new()
        };
        let row = drain_with(ctx, &scen, &key, n, 1, &extra).await;
        let written = if on {
            ctx.client
                .database(&scen.db)
                .collection::<Document>("Timeouts_history")
                .count_documents(doc! {})
                .await
                .ok()
        } else {
            None
        };
        scen.cleanup(ctx).await;
        let mut row = row?;
        row.details["history_rows"] = json!(written);
        eprintln!(
            "dispatch bench: {key}: {:.0} records/s",
            row.records_per_s.unwrap_or(f64::NAN)
        );
        runs.push((on, row));
    }
    let best = |on: bool| {
        runs.iter()
            .filter(|(o, _)| *o == on)
            .map(|(_, r)| r)
            .max_by(|a, b| {
                let rate = |r: &Row| r.records_per_s.unwrap_or(0.0);
                rate(a).total_cmp(&rate(b))
            })
            .cloned()
    };
    let (Some(mut off), Some(mut on)) = (best(false), best(true)) else {
        bail!("no history run finished");
    };
    let rates: Vec<Value> = runs
        .iter()
        .map(|(o, r)| json!({ "history": o, "records_per_s": r.records_per_s, "history_rows": r.details["history_rows"] }))
        .collect();
    let ratio = on
        .records_per_s
        .zip(off.records_per_s)
        .map(|(a, b)| a / b.max(f64::MIN_POSITIVE));
    off.scenario = "history-off".into();
    off.description =
        format!("1 timeoutd process draining {n} due records, history off (best of 2)");
    on.scenario = "history-on".into();
    on.description =
        format!("the same with [history] keep = \"{KEEP}\" (best of 2, alternated with off)");
    on.details["ratio_to_history_off"] = json!(ratio);
    on.details["runs"] = json!(rates);
    Ok(vec![off, on])
}
