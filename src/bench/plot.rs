//! The bench's plot: throughput against request size, one line per op, pattern, batch and
//! thread count (SVG through `plotters`; the x axis is logarithmic, as the sizes double).

use std::path::Path;

use plotters::prelude::*;

use super::types::{BenchPoint, BenchReport};
use crate::error::CliError;

/// Pixels of the SVG.
const SIZE: (u32, u32) = (900, 560);

/// One line of the plot: its label and its (bytes, GB/s) points in ascending size.
fn lines(points: &[BenchPoint]) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut out: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for p in points {
        let label = format!(
            "{} {} batch {} threads {}",
            p.op, p.pattern, p.batch, p.threads
        );
        let xy = (p.block_size as f64, p.gb_per_s);
        match out.iter_mut().find(|(l, _)| *l == label) {
            Some((_, v)) => v.push(xy),
            None => out.push((label, vec![xy])),
        }
    }
    for (_, v) in &mut out {
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

fn size_label(b: f64) -> String {
    let b = b.round() as u64;
    match b {
        _ if b >= 1 << 30 && b.is_multiple_of(1 << 30) => format!("{}G", b >> 30),
        _ if b >= 1 << 20 && b.is_multiple_of(1 << 20) => format!("{}M", b >> 20),
        _ if b >= 1 << 10 && b.is_multiple_of(1 << 10) => format!("{}K", b >> 10),
        _ => b.to_string(),
    }
}

/// Writes the report's points as an SVG line plot to `path`.
///
/// Errors: the file cannot be written, or the plotting library fails (its text).
pub fn write(report: &BenchReport, path: &Path) -> Result<(), CliError> {
    let fail = |e: String| CliError::failed(format!("plotting to {}: {e}", path.display()));
    let series = lines(&report.points);
    let xs = report.points.iter().map(|p| p.block_size as f64);
    let (xmin, xmax) = xs.fold((f64::MAX, f64::MIN), |(l, h), x| (l.min(x), h.max(x)));
    if xmin > xmax {
        return Err(fail("no point to plot".into()));
    }
    // A single size still gets a visible x range.
    let (xmin, xmax) = (xmin / 1.5, xmax * 1.5);
    let ymax = report
        .points
        .iter()
        .map(|p| p.gb_per_s)
        .fold(0.0, f64::max)
        .max(1e-9)
        * 1.15;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        root.fill(&WHITE)?;
        let title = format!(
            "kvferry bench: {} {} on {}, median of {}",
            report.transport, report.mode, report.device, report.repeats
        );
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((xmin..xmax).log_scale(), 0.0..ymax)?;
        chart
            .configure_mesh()
            .x_desc("request size (bytes)")
            .y_desc("GB/s")
            .x_label_formatter(&|x| size_label(*x))
            .draw()?;
        for (i, (label, pts)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
                .label(label.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
            chart.draw_series(
                pts.iter()
                    .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
            )?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| fail(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_op_pattern_batch_and_threads_in_ascending_size() {
        let pt = |op: &str, bs: u64, threads: u64, g: f64| BenchPoint {
            op: op.into(),
            block_size: bs,
            batch: 8,
            threads,
            pattern: "contiguous".into(),
            path: "tcp".into(),
            gb_per_s: g,
            gb_per_s_runs: vec![g],
            spread_pct: 0.0,
            avg_latency_us: 1.0,
            p99_latency_us: 1.0,
            p999_latency_us: 1.0,
            batches: 1,
            checksum_overhead: None,
        };
        let l = lines(&[
            pt("write", 65536, 1, 2.0),
            pt("write", 4096, 1, 1.0),
            pt("read", 4096, 1, 0.5),
            pt("write", 4096, 2, 1.5),
        ]);
        assert_eq!(l.len(), 3);
        assert_eq!(l[0].1, vec![(4096.0, 1.0), (65536.0, 2.0)]);
        assert_eq!(size_label(65536.0), "64K");
        assert_eq!(size_label(1000.0), "1000");
    }
}
