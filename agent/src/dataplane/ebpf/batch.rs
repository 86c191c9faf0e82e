//! Batched map operations (`BPF_MAP_UPDATE_BATCH`, `BPF_MAP_LOOKUP_BATCH`, kernel
//! ≥ 5.6) through a map's fd: aya 0.14 has no batch API.
//!
//! Why: one `bpf()` call per element would be most of a full sync's time. One batch
//! call hands the kernel
//! every element at once (it still updates them one by one, in order, so a later
//! element for the same key wins, as separate calls would).

use aya::Pod;
use std::{io, mem::size_of, os::fd::AsRawFd as _, os::fd::BorrowedFd};

/// `BPF_MAP_LOOKUP_BATCH` from `enum bpf_cmd` (uapi/linux/bpf.h).
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
/// `BPF_MAP_UPDATE_BATCH` from `enum bpf_cmd`.
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;

/// Elements per call: bounds the kernel's work per syscall (it copies one element
/// at a time, but a huge count is refused by no limit we rely on).
const CHUNK: usize = 16_384;

/// The `batch` member of `union bpf_attr` (uapi/linux/bpf.h), zero-padded to the
/// size the kernel accepts for these commands.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Whether an error means "this kernel has no batch operations for this map" (the
/// caller falls back to one call per element).
#[must_use]
pub fn unsupported(e: &io::Error) -> bool {
    // ENOTSUPP (524) is the kernel-internal code some map types return.
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL | libc::EOPNOTSUPP | libc::ENOSYS | 524)
    )
}

fn bpf(cmd: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is a valid `bpf_attr` prefix for the batch commands, its
    // pointers name live buffers of the sizes the kernel derives from `count` and
    // the map's key and value sizes (checked by the callers), and its size is passed.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr),
            size_of::<BatchAttr>(),
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Writes `keys[i] → values[i]` for every `i`, in order (`BPF_ANY`). `K` and `V`
/// must be the map's key and value types (same sizes; per-CPU maps are not
/// supported). On error some leading elements may have been written.
pub fn update<K: Pod, V: Pod>(fd: BorrowedFd<'_>, keys: &[K], values: &[V]) -> io::Result<()> {
    if keys.len() != values.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "batch update: as many keys as values",
        ));
    }
    for (keys, values) in keys.chunks(CHUNK).zip(values.chunks(CHUNK)) {
        let mut attr = BatchAttr {
            keys: keys.as_ptr() as u64,
            values: values.as_ptr() as u64,
            count: keys.len() as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        bpf(BPF_MAP_UPDATE_BATCH, &mut attr)?;
        if attr.count as usize != keys.len() {
            return Err(io::Error::other(format!(
                "batch update wrote {} of {} elements",
                attr.count,
                keys.len()
            )));
        }
    }
    Ok(())
}

/// Every element of a map of at most `max_entries` elements, as (keys, values)
/// (`BPF_MAP_LOOKUP_BATCH`): an array's in index order, a hash map's in bucket
/// order. `K` and `V` must be the map's key and value types (not per-CPU).
pub fn lookup_all<K: Pod + Default + Clone, V: Pod + Default + Clone>(
    fd: BorrowedFd<'_>,
    max_entries: u32,
) -> io::Result<(Vec<K>, Vec<V>)> {
    let mut keys: Vec<K> = Vec::new();
    let mut values: Vec<V> = Vec::new();
    lookup_each(fd, max_entries, |k, v| {
        keys.extend_from_slice(k);
        values.extend_from_slice(v);
    })?;
    Ok((keys, values))
}

/// As [`lookup_all`], handing each call's elements to `each` instead of collecting
/// them: memory for one chunk, however large the map.
pub fn lookup_each<K: Pod + Default + Clone, V: Pod + Default + Clone>(
    fd: BorrowedFd<'_>,
    max_entries: u32,
    mut each: impl FnMut(&[K], &[V]),
) -> io::Result<()> {
    let max = max_entries as usize;
    let size = CHUNK.min(max).max(1);
    let mut keys: Vec<K> = vec![K::default(); size];
    let mut values: Vec<V> = vec![V::default(); size];
    // The position token the kernel hands back (an array index or a hash bucket,
    // 4 bytes for these maps; room for more).
    let mut token = [0u64; 8];
    let mut read = 0usize;
    // Each call either fills its chunk or reaches the end: bounded by the size.
    for call in 0..=max / CHUNK + 1 {
        let want = size.min(max - read).max(1);
        let in_batch = token;
        let mut attr = BatchAttr {
            in_batch: if call == 0 {
                0
            } else {
                in_batch.as_ptr() as u64
            },
            out_batch: token.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: want as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        let result = bpf(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let got = (attr.count as usize).min(want);
        each(&keys[..got], &values[..got]);
        read += got;
        match result {
            Ok(()) if read < max => {}
            Ok(()) => break,
            // The end of the map.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use aya::maps::{Array, HashMap, IterableMap as _, Map, MapData};
    use std::os::fd::{AsFd as _, FromRawFd as _, OwnedFd};

    /// A fresh map from `BPF_MAP_CREATE` (unpinned, gone with its fd), or `None`
    /// without the privileges to create one.
    pub(crate) fn create(
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
    ) -> Option<OwnedFd> {
        #[repr(C)]
        #[derive(Default)]
        struct CreateAttr {
            map_type: u32,
            key_size: u32,
            value_size: u32,
            max_entries: u32,
            map_flags: u32,
        }
        let mut attr = CreateAttr {
            map_type,
            key_size,
            value_size,
            max_entries,
            ..CreateAttr::default()
        };
        // SAFETY: BPF_MAP_CREATE (0) with a zero-padded attr prefix of the given size.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                0,
                std::ptr::from_mut(&mut attr),
                size_of::<CreateAttr>(),
            )
        };
        // SAFETY: a non-negative return is a new fd we own.
        (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }

    const BPF_MAP_TYPE_HASH: u32 = 1;
    pub(crate) const BPF_MAP_TYPE_ARRAY: u32 = 2;

    /// Batch writes land where one-by-one writes would (the last write of a key
    /// wins), and a batch read of an array returns every slot in index order.
    #[test]
    fn batch_writes_and_reads_match_single_element_access() {
        let Some(fd) = create(BPF_MAP_TYPE_ARRAY, 4, 8, 40_000) else {
            eprintln!("skipped: creating a BPF map needs CAP_BPF");
            return;
        };
        // More than one chunk, and index 7 written twice.
        let mut ids: Vec<u32> = (0..20_000).map(|i| i * 2).collect();
        let mut values: Vec<u64> = ids.iter().map(|i| u64::from(*i) * 3 + 1).collect();
        ids.push(7);
        values.push(99);
        ids.push(7);
        values.push(100);
        update(fd.as_fd(), &ids, &values).expect("batch write to an array");
        let (indexes, all): (Vec<u32>, Vec<u64>) =
            lookup_all(fd.as_fd(), 40_000).expect("batch read");
        assert_eq!(indexes, (0..40_000).collect::<Vec<u32>>());
        let array: Array<MapData, u64> =
            Array::try_from(Map::Array(MapData::from_fd(fd).expect("map from fd")))
                .expect("an array");
        for (i, v) in all.iter().enumerate() {
            let i = i as u32;
            let want = if i == 7 {
                100
            } else if i.is_multiple_of(2) {
                u64::from(i) * 3 + 1
            } else {
                0
            };
            assert_eq!(*v, want, "slot {i}");
            assert_eq!(array.get(&i, 0).expect("lookup"), want, "slot {i}");
        }

        let fd = create(BPF_MAP_TYPE_HASH, 4, 8, 1024).expect("a hash map");
        let keys: Vec<u32> = (0..1000).chain([5]).collect();
        let values: Vec<u64> = (0..1000).map(|k| k * 10).chain([555]).collect();
        update(fd.as_fd(), &keys, &values).expect("batch write to a hash map");
        let hash: HashMap<MapData, u32, u64> =
            HashMap::try_from(Map::HashMap(MapData::from_fd(fd).expect("map from fd")))
                .expect("a hash map");
        for k in 0..1000u32 {
            let want = if k == 5 { 555 } else { u64::from(k) * 10 };
            assert_eq!(hash.get(&k, 0).expect("lookup"), want, "key {k}");
        }
        assert_eq!(hash.keys().count(), 1000);
        let (mut read_keys, read_values): (Vec<u32>, Vec<u64>) =
            lookup_all(hash.map().fd().as_fd(), 1024).expect("batch read of a hash map");
        for (k, v) in read_keys.iter().zip(&read_values) {
            assert_eq!(
                *v,
                if *k == 5 { 555 } else { u64::from(*k) * 10 },
                "key {k}"
            );
        }
        read_keys.sort_unstable();
        assert_eq!(read_keys, (0..1000).collect::<Vec<u32>>());

        // A full map refuses the write past its size: an error, not a silent stop.
        let fd = create(BPF_MAP_TYPE_HASH, 4, 8, 10).expect("a small hash map");
        let keys: Vec<u32> = (0..11).collect();
        let values = vec![0u64; 11];
        assert!(update(fd.as_fd(), &keys, &values).is_err());
        assert!(update(fd.as_fd(), &keys[..3], &values[..2]).is_err());
    }
}
