//! Loading the openb node list and pod lists (see `shared/data/traces/SOURCE.md`).

use std::path::Path;

use crate::error::FragError;

/// One GPU node of `openb_node_list_gpu_node.csv`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRow {
    /// Node id (`sn`).
    pub name: String,
    /// CPU capacity, thousandths of a core.
    pub cpu_milli: u64,
    /// Host RAM, MiB.
    pub memory_mib: u64,
    /// GPUs on the node.
    pub gpus: u32,
    /// The trace's GPU model code (ignored by the replay: every GPU becomes the
    /// benchmark's model).
    pub model: String,
}

/// One task of an `openb_pod_list_*.csv`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskRow {
    /// Task id.
    pub name: String,
    /// Requested CPU, thousandths of a core.
    pub cpu_milli: u64,
    /// Requested host RAM, MiB.
    pub memory_mib: u64,
    /// GPUs requested (0 = CPU-only).
    pub num_gpu: u32,
    /// Share of each GPU, thousandths (1000 = whole GPU, 0 for CPU-only).
    pub gpu_milli: u32,
    /// Creation time, seconds, if present.
    pub creation_time: Option<u64>,
    /// Deletion time, seconds, if present.
    pub deletion_time: Option<u64>,
    /// `gpu_spec`: the GPU models the task is constrained to (`|`-separated
    /// in the trace); empty = any. Absent column = any.
    pub gpu_spec: Vec<String>,
}

struct Table {
    path: std::path::PathBuf,
    headers: csv::StringRecord,
    rows: Vec<(u64, csv::StringRecord)>,
}

impl Table {
    fn read(path: &Path) -> Result<Self, FragError> {
        let file = std::fs::File::open(path).map_err(|source| FragError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut rdr = csv::ReaderBuilder::new()
            .has_headers(true)
            .trim(csv::Trim::All)
            .from_reader(std::io::BufReader::new(file));
        let csv_err = |source: csv::Error| FragError::Csv {
            path: path.to_path_buf(),
            line: source.position().map_or(0, csv::Position::line),
            source,
        };
        let headers = rdr.headers().map_err(csv_err)?.clone();
        let mut rows = Vec::new();
        for rec in rdr.records() {
            let rec = rec.map_err(csv_err)?;
            let line = rec.position().map_or(0, csv::Position::line);
            rows.push((line, rec));
        }
        if rows.is_empty() {
            return Err(FragError::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok(Self {
            path: path.to_path_buf(),
            headers,
            rows,
        })
    }

    fn column(&self, name: &'static str) -> Result<usize, FragError> {
        self.headers
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| FragError::MissingColumn {
                path: self.path.clone(),
                column: name,
            })
    }

    fn bad(&self, line: u64, column: &'static str, value: &str, reason: &str) -> FragError {
        FragError::BadValue {
            path: self.path.clone(),
            line,
            column,
            value: value.to_string(),
            reason: reason.to_string(),
        }
    }

    fn text<'r>(
        &self,
        line: u64,
        rec: &'r csv::StringRecord,
        col: (usize, &'static str),
    ) -> Result<&'r str, FragError> {
        let v = rec.get(col.0).unwrap_or("");
        if v.is_empty() {
            return Err(self.bad(line, col.1, v, "empty"));
        }
        Ok(v)
    }

    fn uint(
        &self,
        line: u64,
        rec: &csv::StringRecord,
        col: (usize, &'static str),
    ) -> Result<u64, FragError> {
        let v = rec.get(col.0).unwrap_or("");
        v.parse::<u64>()
            .map_err(|_| self.bad(line, col.1, v, "expected a non-negative integer"))
    }

    fn opt_uint(
        &self,
        line: u64,
        rec: &csv::StringRecord,
        col: Option<(usize, &'static str)>,
    ) -> Result<Option<u64>, FragError> {
        let Some(col) = col else { return Ok(None) };
        match rec.get(col.0).unwrap_or("") {
            "" => Ok(None),
            v => v
                .parse::<u64>()
                .map(Some)
                .map_err(|_| self.bad(line, col.1, v, "expected a non-negative integer or empty")),
        }
    }
}

fn col(t: &Table, name: &'static str) -> Result<(usize, &'static str), FragError> {
    Ok((t.column(name)?, name))
}

/// Load a node list (`sn,cpu_milli,memory_mib,gpu,model`).
///
/// # Errors
/// The file cannot be read, a column is missing, or a value is not valid; the
/// error names the file, line and column.
pub fn load_nodes(path: &Path) -> Result<Vec<NodeRow>, FragError> {
    let t = Table::read(path)?;
    let (sn, cpu, mem, gpu, model) = (
        col(&t, "sn")?,
        col(&t, "cpu_milli")?,
        col(&t, "memory_mib")?,
        col(&t, "gpu")?,
        col(&t, "model")?,
    );
    let mut out = Vec::with_capacity(t.rows.len());
    for (line, rec) in &t.rows {
        let line = *line;
        let cpu_milli = t.uint(line, rec, cpu)?;
        if cpu_milli == 0 {
            return Err(t.bad(line, cpu.1, "0", "a node needs CPU capacity"));
        }
        let memory_mib = t.uint(line, rec, mem)?;
        if memory_mib == 0 {
            return Err(t.bad(line, mem.1, "0", "a node needs memory capacity"));
        }
        let g = t.uint(line, rec, gpu)?;
        let gpus = u32::try_from(g)
            .ok()
            .filter(|&g| g <= 64)
            .ok_or_else(|| t.bad(line, gpu.1, &g.to_string(), "at most 64 GPUs per node"))?;
        out.push(NodeRow {
            name: t.text(line, rec, sn)?.to_string(),
            cpu_milli,
            memory_mib,
            gpus,
            model: rec.get(model.0).unwrap_or("").to_string(),
        });
    }
    Ok(out)
}

/// Load a pod list (`name,cpu_milli,memory_mib,num_gpu,gpu_milli,...`).
/// `creation_time` and `deletion_time` are read when the columns exist.
///
/// # Errors
/// The file cannot be read, a column is missing, or a value is not valid (e.g.
/// `gpu_milli` above 1000, a fractional share on a multi-GPU task); the error
/// names the file, line and column.
pub fn load_tasks(path: &Path) -> Result<Vec<TaskRow>, FragError> {
    let t = Table::read(path)?;
    let (name, cpu, mem, ngpu, milli) = (
        col(&t, "name")?,
        col(&t, "cpu_milli")?,
        col(&t, "memory_mib")?,
        col(&t, "num_gpu")?,
        col(&t, "gpu_milli")?,
    );
    let created = col(&t, "creation_time").ok();
    let deleted = col(&t, "deletion_time").ok();
    let spec_col = col(&t, "gpu_spec").ok();
    let mut out = Vec::with_capacity(t.rows.len());
    for (line, rec) in &t.rows {
        let line = *line;
        let n = t.uint(line, rec, ngpu)?;
        let num_gpu = u32::try_from(n)
            .ok()
            .filter(|&n| n <= 64)
            .ok_or_else(|| t.bad(line, ngpu.1, &n.to_string(), "at most 64 GPUs per task"))?;
        let m = t.uint(line, rec, milli)?;
        if m > 1000 {
            return Err(t.bad(line, milli.1, &m.to_string(), "at most 1000 (one GPU)"));
        }
        let gpu_milli = m as u32;
        if num_gpu == 0 && gpu_milli != 0 {
            return Err(t.bad(
                line,
                milli.1,
                &m.to_string(),
                "a task with num_gpu 0 must request 0",
            ));
        }
        if num_gpu > 0 && gpu_milli == 0 {
            return Err(t.bad(
                line,
                milli.1,
                "0",
                "a GPU task must request a share above 0",
            ));
        }
        if num_gpu > 1 && gpu_milli != 1000 {
            return Err(t.bad(
                line,
                milli.1,
                &m.to_string(),
                "a multi-GPU task must request whole GPUs (1000)",
            ));
        }
        out.push(TaskRow {
            name: t.text(line, rec, name)?.to_string(),
            cpu_milli: t.uint(line, rec, cpu)?,
            memory_mib: t.uint(line, rec, mem)?,
            num_gpu,
            gpu_milli,
            creation_time: t.opt_uint(line, rec, created)?,
            deletion_time: t.opt_uint(line, rec, deleted)?,
            gpu_spec: spec_col
                .and_then(|c| rec.get(c.0))
                .unwrap_or("")
                .split('|')
                .map(str::trim)
                .filter(|m| !m.is_empty())
                .map(str::to_string)
                .collect(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    const POD_HDR: &str = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n";

    #[test]
    fn loads_nodes_and_tasks() {
        let n = file(
            "sn,cpu_milli,memory_mib,gpu,model\nn0,96000,393216,8,G2\nn1,64000,262144,2,P100\n",
        );
        let nodes = load_nodes(n.path()).unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[0].gpus, 8);
        assert_eq!(nodes[1].memory_mib, 262_144);
        let p = file(&format!(
            "{POD_HDR}p0,12000,16384,1,1000,,LS,Running,0,12537496,0\np1,6000,12288,1,460,,LS,Pending,5,,\np2,1000,1024,0,0,,BE,Running,1,2,1\n"
        ));
        let tasks = load_tasks(p.path()).unwrap();
        assert_eq!(tasks.len(), 3);
        assert_eq!(tasks[1].gpu_milli, 460);
        assert_eq!(tasks[1].deletion_time, None);
        assert_eq!(tasks[0].deletion_time, Some(12_537_496));
    }

    #[test]
    fn missing_column_is_named() {
        let n = file("sn,cpu_milli,gpu,model\nn0,96000,8,G2\n");
        let e = load_nodes(n.path()).unwrap_err();
        assert!(
            matches!(
                e,
                FragError::MissingColumn {
                    column: "memory_mib",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains(&n.path().display().to_string()));
    }

    #[test]
    fn bad_value_names_file_line_and_column() {
        let p = file(&format!(
            "{POD_HDR}p0,12000,16384,1,1000,,LS,Running,0,1,0\np1,6000,12288,1,4x0,,LS,Running,0,1,0\n"
        ));
        let e = load_tasks(p.path()).unwrap_err();
        match &e {
            FragError::BadValue {
                line,
                column,
                value,
                ..
            } => {
                assert_eq!(*line, 3);
                assert_eq!(*column, "gpu_milli");
                assert_eq!(value, "4x0");
            }
            other => panic!("unexpected {other}"),
        }
        let msg = e.to_string();
        assert!(msg.contains("line 3") && msg.contains("gpu_milli"), "{msg}");
    }

    #[test]
    fn inconsistent_shares_are_rejected() {
        let over = file(&format!("{POD_HDR}p0,1,1,1,1200,,LS,Running,0,1,0\n"));
        assert!(matches!(
            load_tasks(over.path()),
            Err(FragError::BadValue {
                column: "gpu_milli",
                line: 2,
                ..
            })
        ));
        let multi = file(&format!("{POD_HDR}p0,1,1,2,500,,LS,Running,0,1,0\n"));
        assert!(matches!(
            load_tasks(multi.path()),
            Err(FragError::BadValue {
                column: "gpu_milli",
                ..
            })
        ));
        let neg = file("sn,cpu_milli,memory_mib,gpu,model\nn0,-5,1,1,T4\n");
        assert!(matches!(
            load_nodes(neg.path()),
            Err(FragError::BadValue {
                column: "cpu_milli",
                line: 2,
                ..
            })
        ));
    }

    #[test]
    fn empty_missing_and_ragged_files() {
        let empty = file("sn,cpu_milli,memory_mib,gpu,model\n");
        assert!(matches!(
            load_nodes(empty.path()),
            Err(FragError::Empty { .. })
        ));
        let missing = Path::new("/nonexistent/carve-frag/nodes.csv");
        assert!(matches!(load_nodes(missing), Err(FragError::Io { .. })));
        let ragged = file("sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,1,T4\nn1,1,1\n");
        let e = load_nodes(ragged.path()).unwrap_err();
        assert!(matches!(e, FragError::Csv { line: 3, .. }), "{e}");
    }
}
