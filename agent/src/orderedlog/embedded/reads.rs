//! The store's read side beyond one object: [`ObjectKey`]-ordered scans, counts
//! and orphan endpoints read from the keys alone (what `get` and `status` of a
//! large store need without parsing every document).

use super::{EmbeddedLog, Inner, META, META_REVISION, OBJECTS, parse_key_string, read_meta};
use crate::{
    model::{Kind, Object, ObjectKey},
    orderedlog::{LogError, Revision},
};
use redb::{ReadableDatabase, ReadableTable};
use std::{
    collections::{BTreeMap, HashSet},
    ops::ControlFlow,
};

impl EmbeddedLog {
    /// Endpoints objects whose service does not exist, in key order: from the keys,
    /// without reading a document.
    pub fn orphan_endpoints(&self) -> Result<Vec<ObjectKey>, LogError> {
        let inner = &self.inner;
        let txn = inner.db.begin_read().map_err(|e| inner.storage(e))?;
        let table = txn.open_table(OBJECTS).map_err(|e| inner.storage(e))?;
        let names = |kind: Kind| -> Result<Vec<String>, LogError> {
            let prefix = format!("{kind}/");
            let mut out = Vec::new();
            for row in table
                .range(prefix.as_str()..)
                .map_err(|e| inner.storage(e))?
            {
                let (k, _) = row.map_err(|e| inner.storage(e))?;
                match k.value().strip_prefix(&prefix) {
                    Some(rest) => out.push(rest.to_owned()),
                    None => break,
                }
            }
            Ok(out)
        };
        let services: HashSet<String> = names(Kind::Service)?.into_iter().collect();
        let mut orphans: Vec<ObjectKey> = names(Kind::Endpoints)?
            .into_iter()
            .filter(|n| !services.contains(n))
            .filter_map(|n| parse_key_string(&format!("{}/{n}", Kind::Endpoints)))
            .collect();
        orphans.sort();
        Ok(orphans)
    }

    /// How many objects of each kind the store holds, and its revision: counted from
    /// the keys, without reading a document (`status` of a large store).
    pub fn count(&self) -> Result<(Revision, BTreeMap<Kind, usize>), LogError> {
        let inner = &self.inner;
        let txn = inner.db.begin_read().map_err(|e| inner.storage(e))?;
        let meta = txn.open_table(META).map_err(|e| inner.storage(e))?;
        let table = txn.open_table(OBJECTS).map_err(|e| inner.storage(e))?;
        let revision = read_meta(&meta, META_REVISION, &inner.path)?;
        let mut counts = BTreeMap::new();
        for kind in Kind::ALL {
            let prefix = format!("{kind}/");
            let mut n = 0;
            for row in table
                .range(prefix.as_str()..)
                .map_err(|e| inner.storage(e))?
            {
                let (k, _) = row.map_err(|e| inner.storage(e))?;
                if !k.value().starts_with(&prefix) {
                    break;
                }
                n += 1;
            }
            counts.insert(kind, n);
        }
        Ok((revision, counts))
    }
}

impl Inner {
    /// Passes the objects of `kind` (every kind when `None`) in `namespace` (every
    /// namespace when `None`) to `each` in [`ObjectKey`] order: kinds in
    /// [`Kind::ALL`] order, then namespace, then name, until `each` breaks.
    ///
    /// The table's own order is that of the key strings, where `a-b/…` sorts before
    /// `a/…` (`-` is below `/`): each namespace's rows are contiguous, so the
    /// namespaces are found first by one seek each and then read in their order.
    pub(super) fn scan_ordered(
        &self,
        table: &impl ReadableTable<&'static str, (u64, &'static str)>,
        kind: Option<Kind>,
        namespace: Option<&str>,
        mut each: impl FnMut(&ObjectKey, Object) -> ControlFlow<()>,
    ) -> Result<(), LogError> {
        let kinds = match kind {
            Some(k) => vec![k],
            None => Kind::ALL.to_vec(),
        };
        for kind in kinds {
            let namespaces = match namespace {
                Some(ns) => vec![ns.to_owned()],
                None => self.namespaces(table, kind)?,
            };
            for ns in namespaces {
                let mut stop = false;
                self.scan_objects(table, &format!("{kind}/{ns}/"), |key, _, object| {
                    let flow = each(key, object);
                    stop = flow.is_break();
                    flow
                })?;
                if stop {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// The namespaces holding objects of `kind`, sorted: one seek per namespace.
    fn namespaces(
        &self,
        table: &impl ReadableTable<&'static str, (u64, &'static str)>,
        kind: Kind,
    ) -> Result<Vec<String>, LogError> {
        let prefix = format!("{kind}/");
        let mut out = Vec::new();
        let mut from = prefix.clone();
        loop {
            let mut rows = table.range(from.as_str()..).map_err(|e| self.storage(e))?;
            let Some(row) = rows.next() else { break };
            let (k, _) = row.map_err(|e| self.storage(e))?;
            let Some(rest) = k.value().strip_prefix(&prefix) else {
                break;
            };
            let Some((ns, _)) = rest.split_once('/') else {
                return Err(LogError::Corrupt {
                    what: format!("object {}", k.value()),
                    message: "the key names no namespace".to_owned(),
                });
            };
            out.push(ns.to_owned());
            // '0' follows '/': past every key of this namespace.
            from = format!("{prefix}{ns}0");
        }
        out.sort();
        Ok(out)
    }
}
