//! Writing a CSV file atomically: the rows go to a temporary file in the
//! destination's folder, which replaces the destination only once complete
//! and synced, so a failed write leaves the destination as it was.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use crate::error::FragError;

/// Writes `path` with the rows `fill` writes.
///
/// # Errors
/// The folder is not writable or a row cannot be written; `path` is then
/// left as it was.
pub(crate) fn write_atomically(
    path: &Path,
    fill: impl FnOnce(&mut csv::Writer<BufWriter<&File>>) -> Result<(), csv::Error>,
) -> Result<(), FragError> {
    let werr = |source: std::io::Error| FragError::Write {
        path: path.to_path_buf(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let tmp = tempfile::NamedTempFile::new_in(dir).map_err(werr)?;
    {
        let mut w = csv::Writer::from_writer(BufWriter::new(tmp.as_file()));
        fill(&mut w).map_err(|e| werr(std::io::Error::other(e)))?;
        w.flush().map_err(werr)?;
    }
    tmp.as_file().sync_all().map_err(werr)?;
    tmp.persist(path).map_err(|e| werr(e.error))?;
    Ok(())
}
