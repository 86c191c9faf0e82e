use super::*;
use crate::dataplane::ebpf::batch::tests::{BPF_MAP_TYPE_ARRAY, create};

#[test]
fn regions_cover_the_highest_possible_cpu() {
    assert_eq!(regions_of("0-3\n").unwrap(), 4);
    assert_eq!(regions_of("0").unwrap(), 1);
    assert_eq!(regions_of("0,2-5").unwrap(), 6);
    assert_eq!(regions_of("0-1,4\n").unwrap(), 5);
    assert!(regions_of("").is_err());
    assert!(regions_of("0-x").is_err());
}

/// A scrape's batch read gives every id the sum over CPUs that the per-id read
/// gives, across more than one batch, and zero for ids outside a region.
#[test]
fn the_batch_read_sums_regions_as_the_per_id_read_does() {
    let cpus = possible_cpus().expect("possible CPUs");
    let per_cpu = 20_000u32;
    let value_size = u32::try_from(size_of::<TrafficStats>()).expect("small");
    let Some(fd) = create(BPF_MAP_TYPE_ARRAY, 4, value_size, per_cpu * cpus) else {
        eprintln!("skipped: creating a BPF map needs CAP_BPF");
        return;
    };
    let mut array: Array<MapData, TrafficStats> =
        Array::try_from(Map::Array(MapData::from_fd(fd).expect("map from fd"))).expect("an array");
    let counted = [0, 1, 7, per_cpu - 1];
    for cpu in 0..cpus {
        for id in counted {
            let stats = TrafficStats {
                flows: u64::from(id) + 1,
                packets: u64::from(cpu) + 1,
                bytes: 100,
            };
            array
                .set(lb::stats_slot(cpu, per_cpu, id), stats, 0)
                .expect("write");
        }
    }
    let ids = [7, 0, per_cpu - 1, 3, per_cpu + 10];
    let many = read_many(&array, &ids).expect("batch read");
    let single: Vec<TrafficStats> = ids
        .iter()
        .map(|id| read(&array, *id).expect("read"))
        .collect();
    assert_eq!(many, single);
    let cpus = u64::from(cpus);
    assert_eq!(
        many[0],
        TrafficStats {
            flows: 8 * cpus,
            packets: cpus * (cpus + 1) / 2,
            bytes: 100 * cpus,
        }
    );
    assert_eq!(many[3], TrafficStats::default());
    assert_eq!(many[4], TrafficStats::default());
}
